"""``make demo``: the main job on the built-in tiny model across 2 CPU ranks.

Writes two short clips with sound, starts ``tilecast serve`` on 2 CPU ranks with the tiny
Kandinsky 6 SR checkpoint, sends several requests through the client library (an upload, a
server-side path, and concurrent requests), saves the outputs and prints where they are.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import av
from rich.console import Console
from rich.table import Table

from tilecast.client import Client, read_ready_file
from tilecast.runtime.synthetic import write_test_video

console = Console()


def describe(path: Path) -> str:
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        audio = container.streams.audio[0] if container.streams.audio else None
        sound = f"audio {audio.codec_context.sample_rate} Hz {audio.codec_context.layout.name}" if audio else "silent"
        frames = video.frames or sum(1 for _ in container.decode(video=0))
        size = f"{video.codec_context.width}x{video.codec_context.height}"
        return f"{size}, {frames} frames @ {float(video.average_rate):.0f} fps, {sound}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo_outputs"))
    parser.add_argument("--num-gpus", type=int, default=2)
    args = parser.parse_args(argv)
    out = args.out.resolve()
    inputs, results = out / "inputs", out / "results"
    inputs.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)

    console.rule("[bold]tilecast demo: Kandinsky 6 SR (tiny) on 2 CPU ranks")
    landscape = write_test_video(inputs / "landscape.mp4", 64, 64, 9, 24.0)
    small = write_test_video(inputs / "small.mp4", 32, 32, 11, 30.0)  # subsampled to 9 frames at 24 fps
    console.print(f"inputs: {landscape.name} ({describe(landscape)}), {small.name} ({describe(small)})")

    ready_file = Path(tempfile.mkdtemp(prefix="tilecast-demo-")) / "ready.json"
    command = [
        sys.executable,
        "-m",
        "tilecast",
        "serve",
        "--model-path",
        "tiny/k6sr",
        "--num-gpus",
        str(args.num_gpus),
        "--device",
        "cpu",
        "--port",
        "0",
        "--ready-file",
        str(ready_file),
        "--allowed-video-dir",
        str(inputs),
        "--output-dir",
        str(out / "server"),
        "--vae-config.use-parallel-tiling",
        "true",
    ]
    console.print("[dim]$ " + " ".join(command[1:]).replace(sys.executable, "python"))
    server = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    table = Table("request", "output", "video")
    try:
        endpoint = read_ready_file(ready_file, timeout=300).endpoint
        with Client(endpoint) as client:
            health = client.wait_ready(300)
            console.print(f"server up: {health.model} on {health.world_size} ranks ({endpoint})")
            started = time.perf_counter()

            result = client.generate(
                video=landscape, sr_resolution_scale=2, num_inference_steps=2, seed=42, timeout=600
            )
            saved = result.files[0].save(results)
            table.add_row("upload landscape.mp4, x2", str(saved), describe(saved))

            result = client.generate(video_path=str(small), sr_resolution_scale=4, seed=42, timeout=600)
            saved = result.files[0].save(results)
            table.add_row("video_path small.mp4, x4", str(saved), describe(saved))

            outcomes: list[tuple[str, Path]] = []

            def concurrent(seed: int) -> None:
                with Client(endpoint) as worker:
                    res = worker.generate(
                        video=landscape,
                        sr_resolution_scale=2,
                        seed=seed,
                        output_file_name=f"landscape_seed{seed}.mp4",
                        timeout=600,
                    )
                    outcomes.append((f"concurrent upload, seed {seed}", res.files[0].save(results)))

            threads = [threading.Thread(target=concurrent, args=(seed,)) for seed in (7, 8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            for label, path in sorted(outcomes):
                table.add_row(label, str(path), describe(path))
            elapsed = time.perf_counter() - started
            stats = client.stats()
            client.shutdown()
        console.print(table)
        console.print(
            f"{stats['jobs']['completed']} requests completed in {elapsed:.1f} s; outputs are in [bold]{results}[/bold]"
        )
        return 0
    finally:
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
