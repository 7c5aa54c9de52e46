"""Authentication of the ZeroMQ port (CURVE keys derived from ``--api-key``), who may stop a
server over the wire, and the refusal to serve a non-loopback address without a key."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from typer.testing import CliRunner

from tests.harness import plain_socket, wait_until
from tilecast.client import AsyncClient, AuthenticationError, Client, ServerError
from tilecast.launcher import cli
from tilecast.runtime.config import ServeConfig
from tilecast.runtime.inproc import InProcessServer
from tilecast.runtime.settings import describe
from tilecast.scheduler import protocol as P
from tilecast.scheduler.auth import CurveKeys
from tilecast.scheduler.io_thread import Peer

KEY = "correct horse battery staple"


@pytest.fixture
def keyed_server(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path, api_key=KEY)
    with InProcessServer(config) as server:
        yield server


def _refused_handshakes(server) -> int:
    with Client(server.endpoint, api_key=KEY) as client:
        return client.stats()["refused"]["refused_handshakes"]


@pytest.mark.timeout(60)
def test_the_key_opens_the_server_and_nothing_else_does(keyed_server):
    with Client(keyed_server.endpoint, api_key=KEY) as client:
        result = client.generate(size=2, steps=1, timeout=30)
        assert result.job.state == "completed"
    assert _refused_handshakes(keyed_server) == 0

    for key, needle in ((None, "a client without an API key"), ("wrong key", "this client's API key")):
        with Client(keyed_server.endpoint, api_key=key, timeout=20) as stranger:
            started = time.monotonic()
            with pytest.raises(AuthenticationError, match=needle):
                stranger.submit(size=1)
            assert time.monotonic() - started < 10  # refused at the handshake, not after a timeout
            with pytest.raises(AuthenticationError):  # and every later call fails the same way
                stranger.health()
    wait_until(lambda: _refused_handshakes(keyed_server) >= 2, 10, "two refused handshakes")


@pytest.mark.timeout(60)
def test_a_request_sent_after_a_refused_handshake_never_wedges_the_client(keyed_server):
    """libzmq drops a connection whose handshake it refused for good: a DEALER's blocking send then
    never returns. A request that reaches the client's I/O thread after the refusal (the race behind
    a 10 s "no reply" instead of the refusal) must leave the thread free: it still ends on close."""
    client = Client(keyed_server.endpoint, timeout=20)  # no key: refused
    try:
        wait_until(lambda: client._auth_error is not None, 10, "the refused handshake")
        client._outbox.put([b"", b"sent after the refusal"])
        client._wakeup.wake()
        time.sleep(0.5)
    finally:
        client.close()
    assert not client._thread.is_alive(), "the client's I/O thread is stuck in a send"


@pytest.mark.timeout(60)
def test_a_keyed_server_starts_while_the_previous_one_still_releases_the_zap_endpoint():
    """One ZAP handler per context, bound to ``inproc://zeromq.zap.01``; libzmq frees the name of a
    closed socket a moment later, on its reaper thread (a keyed server right after another failed
    with "Address already in use" under load). Held here for 0.3 s: the new handler waits for it."""
    import threading

    from tilecast.scheduler.auth import ServerAuth

    context = zmq.Context()
    holder = context.socket(zmq.REP)
    holder.bind("inproc://zeromq.zap.01")
    release = threading.Timer(0.3, holder.close, kwargs={"linger": 0})
    release.start()
    auth = ServerAuth(KEY, context)
    try:
        auth.start()
    finally:
        release.join()
        auth.stop()
        context.term()


@pytest.mark.timeout(60)
def test_async_client_with_a_wrong_key_is_refused(keyed_server):
    async def main() -> None:
        async with AsyncClient(keyed_server.endpoint, api_key="not it", timeout=20) as client:
            with pytest.raises(AuthenticationError):
                await client.health()
        async with AsyncClient(keyed_server.endpoint, api_key=KEY) as client:
            assert (await client.health()).status == "serving"

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_raw_socket_without_curve_gets_no_byte_of_service(keyed_server):
    """A plain DEALER (no key) that sends a shutdown: the handshake fails, nothing is processed."""
    with plain_socket(keyed_server.endpoint, receive_timeout_ms=1500) as sock:
        sock.send_multipart(P.encode(P.ShutdownRequest(req_id=1)))
        with pytest.raises(zmq.Again):
            sock.recv_multipart()
    with Client(keyed_server.endpoint, api_key=KEY) as client:
        assert client.health().status == "serving"


@pytest.mark.timeout(60)
def test_the_key_comes_from_the_environment(keyed_server, monkeypatch):
    monkeypatch.setenv("TILECAST_API_KEY", KEY)
    with Client(keyed_server.endpoint) as client:
        assert client.health().status == "serving"


def test_curve_keys_are_derived_from_the_key_alone():
    one, again, other = CurveKeys.from_api_key(KEY), CurveKeys.from_api_key(KEY), CurveKeys.from_api_key("other")
    assert one == again
    assert one.server_public != other.server_public and one.client_public != other.client_public
    assert one.server_public != one.client_public
    assert zmq.curve_public(one.server_secret) == one.server_public
    with pytest.raises(ValueError, match="must not be empty"):
        CurveKeys.from_api_key("")


# ------------------------------------------------------------------ shutdown over the wire
class _Pipeline:
    model_name = "probe"
    params_type = dict


def _scheduler():
    from tilecast.scheduler.batching import BatchingConfig
    from tilecast.scheduler.scheduler import Scheduler

    sent: list = []
    scheduler = Scheduler(
        pipeline=_Pipeline(),
        send=lambda peer, frames: sent.append((peer, frames)),
        batching=BatchingConfig(),
        max_queued=4,
        world_size=1,
    )
    return scheduler, sent


@pytest.mark.parametrize(
    ("peer", "obeyed"),
    [
        (Peer(route=(b"id",), address="192.0.2.7"), False),  # a stranger on the network, no key
        (Peer(route=(b"id",), address=None), False),  # an address ZeroMQ could not tell
        (Peer(route=(b"id",), address="127.0.0.1"), True),  # this machine
        (Peer(route=(b"id",), address="::1"), True),
        (Peer(route=(b"id",), address="192.0.2.7", authenticated=True), True),  # holds the key
    ],
)
def test_shutdown_is_obeyed_only_from_this_machine_or_with_the_key(peer, obeyed):
    scheduler, sent = _scheduler()
    scheduler._handle(("msg", peer, P.encode(P.ShutdownRequest(req_id=9))))
    reply, _ = P.decode(sent[-1][1])
    assert sent[-1][0] is peer
    if obeyed:
        assert isinstance(reply, P.HealthReply) and reply.status == "stopping"
        assert scheduler.refused_shutdowns == 0
    else:
        assert isinstance(reply, P.ErrorReply) and reply.code == "forbidden", reply
        assert "--api-key" in reply.message
        assert scheduler.status == "serving"
        assert scheduler.refused_shutdowns == 1
        assert scheduler.stats()["refused"]["shutdown"] == 1


@pytest.mark.timeout(60)
def test_shutdown_from_this_machine_without_a_key_still_works(tmp_path):
    config = ServeConfig(model_path="test/allreduce", device="cpu", port=0, output_dir=tmp_path)
    with InProcessServer(config) as server:
        with Client(server.endpoint) as client:
            assert client.shutdown().status == "stopping"
            with pytest.raises(ServerError, match="stopping"):
                client.submit(size=1)


# ------------------------------------------------------------------ exposed addresses
@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        (dict(host="0.0.0.0"), "--host 0.0.0.0"),
        (dict(host="192.0.2.7"), "--host 192.0.2.7"),
        (dict(host="*"), "--host *"),
        (dict(http_port=0, http_host="0.0.0.0"), "--http-host 0.0.0.0"),
    ],
)
def test_an_exposed_address_needs_a_key_or_an_explicit_opt_out(fields, flag):
    with pytest.raises(ValueError, match="no --api-key") as err:
        ServeConfig(model_path="test/allreduce", device="cpu", **fields)
    assert flag in str(err.value) and "--allow-unauthenticated" in str(err.value)
    ServeConfig(model_path="test/allreduce", device="cpu", api_key=KEY, **fields)
    ServeConfig(model_path="test/allreduce", device="cpu", allow_unauthenticated=True, **fields)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_key(host):
    ServeConfig(model_path="test/allreduce", device="cpu", host=host)


def test_serve_on_an_exposed_address_without_a_key_exits_before_any_rank(monkeypatch):
    monkeypatch.delenv("TILECAST_API_KEY", raising=False)
    monkeypatch.setattr(cli, "_run_ranks", lambda *a, **k: pytest.fail("ranks were started"))
    result = CliRunner().invoke(
        cli.app, ["serve", "--model-path", "test/allreduce", "--device", "cpu", "--host", "0.0.0.0"]
    )
    assert result.exit_code == 2, result.output
    assert "no --api-key" in result.output


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError, match="--api-key must not be empty"):
        ServeConfig(model_path="test/allreduce", device="cpu", api_key="  ")


def test_the_key_never_shows_in_the_config_repr():
    config = ServeConfig(model_path="test/allreduce", device="cpu", api_key=KEY)
    assert KEY not in repr(config)
    assert KEY not in describe(config)  # the start-up log of the settings every rank holds
