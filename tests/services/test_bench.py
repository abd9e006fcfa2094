"""The benchmarks run end to end and print each figure beside its floor (timing is
reported, never asserted); the embedded server's fsync and payload options take effect."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from bus.server import EmbeddedServer, free_port
from schemas.defaults import SERVER_MAX_PAYLOAD
from schemas.errors import ConfigError
from tests.conftest import Proc, role_url, run_toolbus


def _report(*args: str) -> dict[str, Any]:
    out = run_toolbus("bench", *args, "--json", timeout=150)
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return report


def _assert_machine(report: dict[str, Any]) -> None:
    machine = report["machine"]
    assert len(machine["loadavg"]) == 3 and len(machine["loadavg_end"]) == 3
    assert machine["cpus"] >= 1 and machine["cpus_usable"] >= 1


def _vs(row: dict[str, Any]) -> set[tuple[str, str, str]]:
    """(figure, floor, floor figure) of each comparison of a row, each with a ratio."""
    assert all(v["ratio"] > 0 and v["floor_value"] > 0 for v in row["vs"])
    return {(v["figure"], v["floor"], v["floor_figure"]) for v in row["vs"]}


JS, RR = "raw JetStream publish+ack", "raw request/reply"


def test_bench_calls_reports_each_figure_beside_its_raw_floor() -> None:
    report = _report("calls", "--n", "50", "--concurrency", "4", "--turns", "20")
    _assert_machine(report)
    assert report["fsync"] == "batch" and report["failures"] == 0
    rows = report["rows"]
    assert [(r["name"], r["concurrency"]) for r in rows] == [
        (JS, 1), (RR, 1), (JS, 4), ("toolbus call built-in:echo", 1),
        ("toolbus call built-in:echo", 4), ("one session, turns 1..10", 1),
        ("one session, turns 11..20", 1)]
    assert all(r["vs"] == [] for r in rows[:3])
    seq, par, early, late = rows[3:]
    assert _vs(seq) == {("p50", JS, "p50"), ("p99", JS, "p50"),
                        ("p50", RR, "p50"), ("p99", RR, "p50")}
    assert _vs(par) == {("per_s", JS, "per_s")}
    assert [v["floor_concurrency"] for v in par["vs"]] == [1, 4]  # sequential, then pipelined
    assert early["vs"] == [] and _vs(late) == {("p50", early["name"], "p50"),
                                               ("p99", early["name"], "p50")}
    assert set(report["ratios"]) == {
        "seq_p50_vs_js_publish", "seq_p99_vs_js_publish", "seq_p50_vs_request_reply",
        "seq_p99_vs_request_reply", "throughput_vs_js_publish_seq",
        "throughput_vs_js_publish", "late_turns_p50_vs_early"}


def test_bench_calls_with_fsync_always_prints_the_machine_floors_and_ratios() -> None:
    out = run_toolbus("bench", "calls", "--n", "50", "--concurrency", "4", "--turns", "20",
                      "--fsync", "always", timeout=150)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("toolbus bench calls: load ") and " CPUs" in lines[0]
    assert "fsync always" in lines[0]
    head = lines[1].split()
    assert head[:2] == ["measure", "in"] and head[-2:] == ["floor", "ratio"]
    assert "p99 ms" in lines[1] and "per s" in lines[1]
    seq = next(i for i, ln in enumerate(lines) if ln.startswith("toolbus call built-in:echo"))
    assert f"{JS} [1] p50" in lines[seq] and "p99 " in lines[seq] and "x" in lines[seq]
    assert f"{RR} [1] p50" in lines[seq + 1]
    assert any("one session, turns 1..10 [1] p50" in ln for ln in lines)
    assert "failures: 0" in out.stdout


def test_bench_validation_reports_the_cost_per_call_next_to_a_json_decode() -> None:
    out = run_toolbus("bench", "validation", "--n", "4000", "--json")
    assert out.returncode in (0, 1), out.stderr  # 1 = over the 20 µs target: reported, not asserted
    report = json.loads(out.stdout)
    _assert_machine(report)
    assert report["schema_fields"] == 10 and report["target_us"] == 20.0
    assert report["n"] == 4000  # --n is used, not dropped
    for key in ("json_decode_us", "toolbus_valid_us", "toolbus_invalid_all_violations_us",
                "fastjsonschema_valid_us", "ratio_to_json_decode"):
        assert report[key] > 0, key


def test_bench_mcp_reports_toolbus_beside_a_direct_mcp_client_and_the_raw_floor() -> None:
    report = _report("mcp", "--n", "32", "--concurrency", "4")
    _assert_machine(report)
    assert report["failures"] == 0
    rows = report["rows"]
    direct, through = "direct mcp.Client.call_tool", "toolbus call (MCP tool)"
    assert [(r["name"], r["concurrency"]) for r in rows] == [
        (JS, 1), (RR, 1), (direct, 1), (through, 1), (direct, 4), (through, 4)]
    assert _vs(rows[3]) == {("p50", direct, "p50"), ("p99", direct, "p50"),
                            ("p50", JS, "p50"), ("p99", JS, "p50")}
    assert _vs(rows[5]) == {("per_s", direct, "per_s"), ("per_s", JS, "per_s")}
    assert set(report) >= {"overhead_p50_ms", "overhead_p50_vs_js_publish", "ratio_p50",
                           "ratio_p99", "throughput_ratio"}


def test_bench_replay_times_the_fold_and_the_cli_beside_their_floors() -> None:
    report = _report("replay", "--events", "300")
    _assert_machine(report)
    assert report["events"] == 300
    figures = report["figures"]
    assert set(figures) == {"in_process", "read", "fold", "decode", "cli_replay", "cli_import",
                            "python_start"}
    for key in ("in_process", "cli_replay", "cli_import"):
        assert figures[key]["floor"] in figures and figures[key]["ratio"] > 0, key
    assert figures["in_process"]["target_ms"] == 150 and figures["cli_import"]["target_ms"] == 300
    assert all(f["best_ms"] > 0 and f["median_ms"] >= f["best_ms"] for f in figures.values())

    out = run_toolbus("bench", "replay", "--events", "100", timeout=150)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("toolbus bench replay: load ") and " CPUs" in out.stdout
    assert "floor" in out.stdout and "ratio" in out.stdout
    assert "python -c pass (median" in out.stdout


def test_bench_agent_reports_a_planner_turn_beside_the_same_model_round_trips_sent_directly(
) -> None:
    report = _report("agent", "--n", "20", "--turns", "10")
    _assert_machine(report)
    assert report["failures"] == 0 and report["n"] == 20 and report["turns"] == 10
    rows = report["rows"]
    direct, turn = "direct httpx, 2 model round trips", "toolbus turn, fresh sessions"
    late_direct = "direct httpx, bodies of turn 10"
    early, late = "5 sessions, turns 1..5", "5 sessions, turns 6..10"
    chain = "raw JetStream chain, 5 hops"
    aiohttp = "direct aiohttp, 2 model round trips"
    bare = "bare turn: 4 hops, 2 model round trips"
    bare_events = "bare event-model turn: 11 events, 16 deliveries"
    assert [r["name"] for r in rows] == [JS, RR, chain, direct, aiohttp, bare, bare_events,
                                         turn, early, late_direct, late]
    assert all(r["n"] == 20 for r in rows[:8]) and rows[8]["n"] == rows[10]["n"] == 25
    assert _vs(rows[2]) == {("p50", JS, "p50"), ("p99", JS, "p50")}
    assert _vs(rows[5]) == {("p50", direct, "p50"), ("p99", direct, "p50")}
    assert _vs(rows[6]) == {("p50", direct, "p50"), ("p99", direct, "p50")}
    assert _vs(rows[7]) == {("p50", direct, "p50"), ("p99", direct, "p50"),
                            ("p50", bare, "p50"), ("p99", bare, "p50"),
                            ("p50", JS, "p50"), ("p99", JS, "p50")}
    assert _vs(rows[8]) == {("p50", direct, "p50"), ("p99", direct, "p50")}
    assert _vs(rows[10]) == {("p50", early, "p50"), ("p99", early, "p50"),
                            ("p50", late_direct, "p50"), ("p99", late_direct, "p50")}
    # The bare turn, the floor of a turn of this shape: the goal's measure of it, and what
    # toolbus adds beyond it, add up; its own processes spent CPU on it.
    assert report["bare_turn_p50_ms"] == pytest.approx(rows[5]["p50_ms"], abs=0.002)
    assert report["bare_overhead_p50_ms"] == pytest.approx(
        rows[5]["p50_ms"] - rows[3]["p50_ms"], abs=0.002)
    assert report["overhead_beyond_bare_p50_ms"] == pytest.approx(
        rows[7]["p50_ms"] - rows[5]["p50_ms"], abs=0.002)
    bare_cpu = report["cpu_per_bare_turn_ms"]
    assert {"bare actor", "bare worker", "nats-server", "model server"} <= set(bare_cpu)
    # The bare event-model turn likewise: the event model alone, and toolbus beyond it.
    assert report["bare_events_turn_p50_ms"] == pytest.approx(rows[6]["p50_ms"], abs=0.002)
    assert report["bare_events_overhead_p50_ms"] == pytest.approx(
        rows[6]["p50_ms"] - rows[3]["p50_ms"], abs=0.002)
    assert report["overhead_beyond_bare_events_p50_ms"] == pytest.approx(
        rows[7]["p50_ms"] - rows[6]["p50_ms"], abs=0.002)
    assert {"bare actor", "bare worker", "nats-server", "model server"} <= set(
        report["cpu_per_bare_events_turn_ms"])
    # Messages through nats-server per turn: a bare turn's four hops are at least four
    # publishes, four acks of them and four deliveries; a toolbus turn stores eleven events.
    bare_msgs, msgs = report["messages_per_bare_turn"], report["messages_per_turn"]
    assert bare_msgs["in"] >= 8 and bare_msgs["out"] >= 8, bare_msgs
    assert msgs["in"] > 11 and msgs["out"] > 11, msgs
    # The bare event-model turn stores as many events and makes as many deliveries: the
    # request and its eleven events published and acked, sixteen deliveries acked.
    bev = report["messages_per_bare_events_turn"]
    assert bev["in"] >= 1 + 11 + 16 and bev["out"] >= 1 + 11 + 16, bev
    # The planner's own client, beside the httpx floor the goal is judged against.
    assert report["direct_aiohttp_p50_ms"] == pytest.approx(rows[4]["p50_ms"], abs=0.002)
    assert report["overhead_vs_aiohttp_p50_ms"] == pytest.approx(
        rows[7]["p50_ms"] - rows[4]["p50_ms"], abs=0.002)
    assert set(report) >= {"overhead_p50_ms", "overhead_p50_vs_js_publish", "ratio_p50",
                           "ratio_p99", "early_overhead_p50_ms", "late_overhead_p50_ms",
                           "late_turns_p50_vs_early", "growth_ms_per_100_turns", "goal",
                           "path_hops", "raw_chain_p50_ms",
                           "overhead_beyond_raw_chain_p50_ms", "late_vs_early_beside_fresh",
                           "fresh_beside_p50_ms", "growth_ms_per_100_turns_beside_fresh"}
    # The goal's verdict is the drift-corrected ratio's.
    # The late bodies are a long session's last turn's: its 10 messages, 9 before it.
    assert report["user_messages_read"] == [1, 10]
    beside = report["late_vs_early_beside_fresh"]
    assert abs(beside - 1.1) < 0.006 or report["goal"]["flat_met"] == (beside <= 1.1)
    # Five hops one after another take longer than one publish+ack, and the split of the
    # overhead adds up.
    assert report["path_hops"] == 5 and rows[2]["p50_ms"] > rows[0]["p50_ms"]
    assert report["overhead_beyond_raw_chain_p50_ms"] == pytest.approx(
        report["overhead_p50_ms"] - report["raw_chain_p50_ms"], abs=0.002)
    assert set(report["goal"]) == {"overhead_p50_ms", "overhead_met", "flat_within",
                                   "flat_met"}
    # Every process the benchmark started spent CPU on the turns, and the total adds up.
    cpu = report["cpu_per_turn_ms"]
    assert {"this client", "nats-server", "toolbus up", "model server"} <= set(cpu), cpu
    parts = sum(v for k, v in cpu.items() if k != "all")
    assert cpu["all"] > 0 and abs(cpu["all"] - parts) < 0.05, cpu



def test_bench_compress_reports_compression_beside_json_and_injection_beside_the_raw_floor(
) -> None:
    report = _report("compress", "--n", "20")
    _assert_machine(report)
    assert report["failures"] == 0 and report["n"] == 20
    result = report["result"]
    assert set(result) == {"chars", "items", "preview_chars", "preview_budget",
                           "preview_items", "recall_chars", "recall_budget", "recall_items",
                           "transform"}
    assert (result["chars"], result["items"], result["preview_items"]) == (31_863, 30, 3)
    assert 0 < result["preview_chars"] <= result["preview_budget"] == 800
    assert result["recall_budget"] == 4000 and result["recall_items"] >= 1
    rows = report["rows"]
    encode, search = "compress.result_text (JSON)", "jmespath.search, precompiled"
    nats_inject, http_inject = "inject over NATS", "inject over HTTP (gateway)"
    assert [r["name"] for r in rows] == [
        encode, "compress.preview (800 chars)", "compress.recall (4000 chars)", search,
        "compress.transform", JS, RR, nats_inject, http_inject]
    assert all(r["n"] == 20 and r["concurrency"] == 1 for r in rows)
    latency = {("p50", "p50"), ("p99", "p50")}

    def against(floor: str) -> set[tuple[str, str, str]]:
        return {(mine, floor, theirs) for mine, theirs in latency}

    assert _vs(rows[1]) == _vs(rows[2]) == against(encode)
    assert _vs(rows[4]) == against(search)
    assert _vs(rows[7]) == against(JS)
    assert _vs(rows[8]) == against(JS) | against(nats_inject)
    assert set(report["ratios"]) == {
        "preview_p50_vs_result_text", "recall_p50_vs_result_text", "transform_p50_vs_jmespath",
        "inject_nats_p50_vs_js_publish", "inject_http_p50_vs_js_publish",
        "inject_http_p50_vs_nats"}

    out = run_toolbus("bench", "compress", "--n", "10", timeout=150)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("toolbus bench compress: load ") and " CPUs" in lines[0]
    assert "31,863-character 30-item list_commits result" in lines[0]
    preview = next(ln for ln in lines if ln.startswith("compress.preview"))
    assert f"{encode} [1] p50" in preview and "x" in preview
    http = next(i for i, ln in enumerate(lines) if ln.startswith(http_inject))
    assert f"{JS} [1] p50" in lines[http] and f"{nats_inject} [1] p50" in lines[http + 1]
    assert lines[-1].startswith("injection until stored: over NATS p50 ")
    assert "failures: 0" in lines[-1]

async def test_the_sample_model_server_calls_echo_for_a_user_message_then_answers_the_result(
) -> None:
    """What the agent benchmark relies on, through the planner's own provider layer:
    streamed and not, with the key checked."""
    from actors.llm import complete
    from actors.llm.types import Message, ModelSettings
    from actors.tools.builtins import BUILTINS
    from schemas.errors import ModelError
    from services.sample_llm import SampleModel, listen

    server = await listen(SampleModel(api_key="k"))
    port = server.sockets[0].getsockname()[1]
    settings = ModelSettings(provider="openai", model="sample", api_key="k", max_retries=0,
                             base_url=f"http://127.0.0.1:{port}/v1")
    tools = [t.spec for t in BUILTINS]
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    try:
        for stream in (None, on_delta):
            asked = [Message(role="user", text="hi")]
            first = await complete(settings, system="Be brief.", messages=asked, tools=tools,
                                   on_delta=stream)
            assert [(c.name, c.arguments) for c in first.tool_calls] == [
                ("built-in:echo", {"text": "hi"})]
            answered = [*asked, Message(role="assistant", tool_calls=first.tool_calls),
                        Message(role="tool", tool_call_id=first.tool_calls[0].id,
                                text='{"text": "hi"}')]
            second = await complete(settings, system=None, messages=answered, tools=tools,
                                    on_delta=stream)
            assert second.text == 'The tool answered: {"text": "hi"}' and not second.tool_calls
            assert second.finish_reason == "stop" and second.usage.output_tokens > 0
        assert "".join(deltas) == second.text
        wrong = msgspec.structs.replace(settings, api_key="nope")
        with pytest.raises(ModelError, match="Incorrect API key"):
            await complete(wrong, system=None, messages=asked, tools=tools)
    finally:
        server.close()
        await server.wait_closed()


# --- the embedded server's options -------------------------------------------------------


def _varz(server: EmbeddedServer) -> dict[str, Any]:
    url = f"http://{server.host}:{server.monitor_port}/varz"
    with urllib.request.urlopen(url, timeout=5) as resp:
        varz: dict[str, Any] = json.load(resp)
    return varz


@pytest.mark.parametrize("fsync", ["batch", "always"])
def test_embedded_server_fsyncs_as_asked_and_takes_8_mb_messages(
    tmp_path: Path, fsync: str
) -> None:
    with EmbeddedServer(tmp_path, port=free_port(), fsync=fsync,
                        monitor_port=free_port()) as server:
        varz = _varz(server)
    config = varz["jetstream"]["config"]
    assert config.get("sync_always", False) is (fsync == "always")
    assert config["store_dir"] == str(tmp_path / "jetstream" / "jetstream")  # where it was
    assert varz["max_payload"] == SERVER_MAX_PAYLOAD == 8 * 1024 * 1024


def test_embedded_server_refuses_an_unknown_fsync_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fsync must be one of batch, always"):
        EmbeddedServer(tmp_path, fsync="never")


async def test_toolbus_up_fsync_always_reaches_the_embedded_server(tmp_path: Path) -> None:
    port = free_port()
    data = tmp_path / "data"
    up = Proc("up", "--fsync", "always", "--port", str(port), "--data-dir", str(data),
              ready="stop:")
    try:
        await up.wait_ready()
        assert "sync_interval: always" in (data / "nats-server.conf").read_text()
        nc = await nats.connect(role_url(data, "client"))
        try:
            assert nc.max_payload == SERVER_MAX_PAYLOAD
        finally:
            await nc.close()
    finally:
        assert up.stop() == 0


# --- a benchmark stopped halfway ----------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, pp in parents.items() if pp == parent]
        out += children
        frontier += children
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc to find the children")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_benchmark_killed_halfway_leaves_no_process_running(sig: str,
                                                              tmp_path: Path) -> None:
    # `timeout`, a CI job's end and `kill` send SIGTERM: the benchmark stops what it started
    # and removes its folders, as on Ctrl-C. Killed outright, its servers still go (they
    # get SIGTERM when it dies).
    import signal
    import subprocess
    import time

    from tests.conftest import REPO, toolbus_cmd

    env = {**__import__("os").environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(toolbus_cmd("bench", "agent", "--n", "100000"), cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(_descendants(proc.pid)) < 4:  # model server, nats-server, up, worker
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
            time.sleep(0.2)
        time.sleep(2)  # measuring by now
        children = _descendants(proc.pid)
        proc.send_signal(getattr(signal, sig))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == (143 if sig == "SIGTERM" else -9), err
        if sig == "SIGTERM":
            assert err.strip().endswith("toolbus: terminated"), err
            assert "Traceback" not in err and "destroyed" not in err, err
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in children if _alive(p)]
        if sig == "SIGTERM":
            assert not list(tmp_path.iterdir())  # its temporary folders are gone
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
