"""Batching rules files: matching, precedence, and every start-up error a user can make."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tilecast.scheduler.batching_rules import BatchingRule, BatchingRules, normalize_resolution

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "rules.json"
    path.write_text(text)
    return path


def rules_of(*rules: dict) -> BatchingRules:
    return BatchingRules.from_dict({"schema_version": 1, "rules": list(rules)})


# ---- matching and precedence -------------------------------------------------------------


def test_reference_rule_caps_qwen_image_1024_only():
    rules = rules_of({"model_contains": "Qwen-Image", "resolution": "1024x1024", "max_batch_size": 1})
    assert rules.cap_for(model="Qwen/Qwen-Image", task="t2i", resolution="1024x1024") == 1
    # Every named criterion must match: other resolution, other model, no resolution.
    assert rules.cap_for(model="Qwen/Qwen-Image", task="t2i", resolution="512x512") is None
    assert rules.cap_for(model="black-forest-labs/FLUX.1-dev", task="t2i", resolution="1024x1024") is None
    assert rules.cap_for(model="Qwen/Qwen-Image", task="t2i", resolution=None) is None


def test_model_contains_is_case_insensitive():
    rules = rules_of({"model_contains": "Qwen-Image", "max_batch_size": 2})
    assert rules.cap_for(model="tiny/qwen-image", task="t2i", resolution="64x64") == 2


def test_smallest_matching_cap_wins_and_non_matching_rules_are_ignored():
    rules = rules_of(
        {"model_contains": "FLUX", "max_batch_size": 4},
        {"resolution": "1024x1024", "max_batch_size": 2},
        {"model_contains": "FLUX", "resolution": "2048x2048", "max_batch_size": 1},  # not matching
        {"task": "t2v", "max_batch_size": 1},  # not matching
    )
    assert rules.cap_for(model="FLUX.1-dev", task="t2i", resolution="1024x1024") == 2
    assert rules.cap_for(model="FLUX.1-dev", task="t2i", resolution="512x512") == 4
    assert rules.cap_for(model="Wan2.1-T2V", task="t2v", resolution="1024x1024") == 1


def test_task_rule_caps_every_model_of_that_task():
    rules = rules_of({"task": "t2v", "max_batch_size": 2})
    assert rules.cap_for(model="Wan2.1-T2V-1.3B", task="t2v", resolution="832x480") == 2
    assert rules.cap_for(model="FLUX.1-dev", task="t2i", resolution="832x480") is None


def test_resolution_is_normalised():
    assert normalize_resolution(" 1024X768 ") == "1024x768"
    assert BatchingRule(resolution="512X512", max_batch_size=2).resolution == "512x512"


def test_example_rules_file_loads():
    rules = BatchingRules.load(REPO / "configs" / "batching" / "example.json")
    assert rules.cap_for(model="Qwen/Qwen-Image", task="t2i", resolution="1024x1024") == 1
    assert len(rules.rules) >= 1


def test_empty_rule_list_is_allowed():
    assert BatchingRules.from_json('{"schema_version": 1, "rules": []}').rules == ()


# ---- errors that stop start-up -----------------------------------------------------------


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen", "max_batchsize": 1}]},
            "unknown key 'max_batchsize' in rule 0; did you mean 'max_batch_size'?",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen"}]},
            "rule 0 is missing 'max_batch_size'",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen", "max_batch_size": 0}]},
            "max_batch_size must be a positive integer, got 0",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen", "max_batch_size": -2}]},
            "max_batch_size must be a positive integer, got -2",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen", "max_batch_size": 2.5}]},
            "max_batch_size must be a positive integer, got 2.5",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen", "max_batch_size": "2"}]},
            "max_batch_size must be a positive integer, got '2'",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "Qwen", "max_batch_size": True}]},
            "max_batch_size must be a positive integer, got True",
        ),
        (
            {"schema_version": 2, "rules": []},
            "unsupported schema_version 2 (expected 1)",
        ),
        ({"rules": []}, "missing 'schema_version' (expected 1)"),
        ({"schema_version": 1}, "missing 'rules'"),
        ({"schema_version": 1, "rules": {}}, "'rules' must be a list"),
        ({"schema_version": 1, "rules": ["Qwen"]}, "rule 0 must be a JSON object"),
        (
            {"schema_version": 1, "rules": [{"resolution": "1024by1024", "max_batch_size": 1}]},
            "rule 0: resolution '1024by1024' is not WIDTHxHEIGHT",
        ),
        (
            {"schema_version": 1, "rules": [{"resolution": "0x512", "max_batch_size": 1}]},
            "resolution '0x512' is not WIDTHxHEIGHT",
        ),
        (
            {"schema_version": 1, "rules": [{"task": "i2v", "max_batch_size": 1}]},
            "task must be one of t2i, t2v, sr, got 'i2v'",
        ),
        (
            {"schema_version": 1, "rules": [{"model_contains": "", "max_batch_size": 1}]},
            "model_contains must be a non-empty string",
        ),
        (
            {"schema_version": 1, "rules": [{"max_batch_size": 1}]},
            "rule 0: the rule names no criterion",
        ),
        (
            {"schema_version": 1, "rule": []},
            "unknown key 'rule' at the top level; did you mean 'rules'?",
        ),
        ([1, 2], "the top level must be a JSON object, got list"),
    ],
)
def test_bad_rules_file_stops_start_up(tmp_path, document, message):
    path = write(tmp_path, json.dumps(document))
    with pytest.raises(ValueError) as info:
        BatchingRules.load(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    path = write(tmp_path, '{"schema_version": 1, "rules": [{"gpu": "H200", "task": "t2i", "max_batch_size": 1}]}')
    with pytest.raises(ValueError, match=r"unknown key 'gpu' in rule 0 \(valid keys: model_contains, resolution, task"):
        BatchingRules.load(path)


def test_bad_json_reports_line_and_column(tmp_path):
    path = write(tmp_path, '{\n  "schema_version": 1,\n  "rules": [\n    {"max_batch_size": 1,}\n  ]\n}\n')
    with pytest.raises(ValueError, match=r"invalid JSON at line 4, column 26"):
        BatchingRules.load(path)


def test_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"batching config file not found: .*nope\.json"):
        BatchingRules.load(tmp_path / "nope.json")


def test_every_problem_is_listed_at_once(tmp_path):
    path = write(
        tmp_path,
        json.dumps(
            {
                "schema_version": 1,
                "rules": [
                    {"model_contains": "Qwen", "max_batchsize": 1},
                    {"resolution": "1024by1024", "max_batch_size": 0},
                ],
            }
        ),
    )
    with pytest.raises(ValueError) as info:
        BatchingRules.load(path)
    text = str(info.value)
    assert "has 4 problems" in text
    assert "unknown key 'max_batchsize' in rule 0" in text
    assert "rule 0 is missing 'max_batch_size'" in text
    assert "rule 1: max_batch_size must be a positive integer, got 0" in text
    assert "rule 1: resolution '1024by1024'" in text
