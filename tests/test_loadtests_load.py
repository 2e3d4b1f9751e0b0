"""The load generator and token check against the fake backend through an in-process router."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from loadtests import LoadConfig, RequestSpec, build_specs, check_tokens, make_reference, run_load
from loadtests.load import compare_ids
from relocator.router.client import RouterControl
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.fakeserver import start_fake, write_fake_tokenizer
from relocator.router.server import RouterServer

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
async def env(tmp_path_factory):
    fakes, runners = [], []
    for _ in range(2):
        eng, runner, url = await start_fake("fake")
        eng.knobs.token_delay_s = 0.002
        fakes.append((eng, url))
        runners.append(runner)
    srv = await RouterServer(RouterSettings(
        port=0, control_port=0, hold_timeout_s=10,
        backends=[BackendConfig(model="fake", url=fakes[0][1], worker_id="w1",
                                tokenizer=str(write_fake_tokenizer(tmp_path_factory.mktemp("tok"))))]
    )).start()
    yield srv, fakes
    await srv.stop()
    for r in runners:
        await r.cleanup()


async def test_compare_ids():
    assert compare_ids([1, 2, 3], [1, 2, 3])["first_divergence"] == -1
    assert compare_ids([1, 2, 3, 4], [1, 2, 4]) == {"lost": 1, "duplicated": 0,
                                                    "mismatched": 0, "first_divergence": 2}
    assert compare_ids([1, 2, 3, 4], [1, 2, 3, 3, 4])["duplicated"] == 1
    c = compare_ids([1, 2, 3, 4], [1, 9, 3, 4])
    assert (c["mismatched"], c["lost"], c["duplicated"]) == (1, 0, 0)
    assert compare_ids([1, 2, 3, 4], [1, 2])["lost"] == 2  # truncated stream


async def test_mix_is_deterministic_and_shaped():
    cfg = LoadConfig(url="http://127.0.0.1:1", distinct=40, chat_fraction=0.5,
                     greedy_fraction=0.5, prompt_words=[4, 8], output_tokens=[5, 9], seed=3)
    a, b = build_specs(cfg), build_specs(cfg)
    assert [s.key for s in a] == [s.key for s in b] and len({s.key for s in a}) == 40
    assert {s.kind for s in a} == {"chat", "completions"}
    assert {s.greedy for s in a} == {True, False}
    assert {s.max_tokens for s in a} == {5, 9}
    seeded = [s.body("m") for s in a if not s.greedy]
    assert all(b["temperature"] > 0 and isinstance(b["seed"], int) for b in seeded)
    assert all(s.body("m")["return_token_ids"] is True for s in a)


async def test_load_through_switch_token_exact(env, tmp_path):
    srv, fakes = env
    cfg = LoadConfig(url=srv.url, concurrency=6, requests=60, output_tokens=[20, 60],
                     prompt_words=[3, 12], seed=1)
    ref = await make_reference(cfg, url=fakes[1][1])
    assert ref and all(len(v) in (20, 60) for v in ref.values())
    task = asyncio.create_task(run_load(cfg))
    a = time.time()
    async with RouterControl(srv.control_url) as rc:
        # Switch only while streams are in flight (a fixed sleep is a race on a busy machine).
        for _ in range(200):
            reps = (await rc.replicas())["models"]["fake"]
            if any(r["in_flight"] > 0 for r in reps):
                break
            await asyncio.sleep(0.02)
        await rc.hold("w1")
        await asyncio.sleep(0.1)
        info = await rc.switch("w1", fakes[1][1])
    b = time.time()
    rep = await task
    assert info["moved_streams"] >= 1
    tc = check_tokens(rep, ref)
    s = rep.summary()
    assert s["requests"] == 60 and s["failed_requests"] == 0, s["errors"]
    assert tc.ok and tc.checked == sum(r.greedy for r in rep.results) and tc.exact == tc.checked
    assert (tc.tokens_lost, tc.tokens_duplicated, tc.tokens_mismatched) == (0, 0, 0)
    assert s["ttft_ms"]["p50"] > 0 and s["itl_ms"]["max"] >= s["itl_ms"]["p50"]
    assert {r.stream for r in rep.results} == set(range(6))
    rep.write_json(tmp_path / "r.json")
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["summary"]["tokens_lost"] == 0 and len(d["requests"]) == 60
    png = rep.write_png(tmp_path / "t.png", phases=[("hold", a, a + 0.1), ("switch", a + 0.1, b)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from rich.console import Console

    Console(file=open(tmp_path / "table.txt", "w"), width=120).print(rep.table())
    assert "lost / duplicated / mismatched" in (tmp_path / "table.txt").read_text()


async def test_token_check_catches_damage(env, tmp_path):
    srv, fakes = env
    cfg = LoadConfig(url=srv.url, concurrency=2, requests=8, greedy_fraction=1.0,
                     output_tokens=[10], distinct=2)
    ref = await make_reference(cfg, url=fakes[1][1])
    rep = await run_load(cfg)
    assert check_tokens(rep, ref).ok
    r0, r1, r2 = rep.results[:3]
    r0.token_ids = r0.token_ids[:-3]  # lost
    r1.token_ids = r1.token_ids[:5] + r1.token_ids[4:]  # duplicated
    r2.token_ids = [r2.token_ids[0] + 1] + r2.token_ids[1:]  # mismatched
    tc = check_tokens(rep, ref)
    assert (tc.tokens_lost, tc.tokens_duplicated, tc.tokens_mismatched) == (3, 1, 1)
    assert not tc.ok and len(tc.bad) == 3 and tc.exact == 5
    assert tc.texts_checked == 8 and tc.text_mismatched == 0  # ids damaged here, not text
    # right ids, wrong text (a splice that repeated text): counted apart
    r3 = rep.results[3]
    r3.text = r3.text[:4] + r3.text
    tc = check_tokens(rep, ref)
    assert tc.text_mismatched == 1 and tc.text_bad[0]["first_difference"] <= 4
    assert rep.summary()["text_mismatched"] == 1
    # the reference keeps its text on disk
    from loadtests import load_reference, save_reference

    save_reference(ref, tmp_path / "ref.json")
    back = load_reference(tmp_path / "ref.json")
    assert dict(back) == dict(ref) and back.text == ref.text and ref.text


async def test_errors_duration_and_stop(env):
    srv, fakes = env
    # unknown model: every request is a recorded HTTP error, nothing raises
    rep = await run_load(LoadConfig(url=srv.url, model="nope", concurrency=2, requests=4))
    assert rep.summary()["failed_requests"] == 4
    assert all(r.status == 404 and r.error.startswith("http 404") for r in rep.results)
    # a broken stream with no sibling is continued (one-shot cut): still no error
    fakes[0][0].knobs.cut_after = 3
    rep = await run_load(LoadConfig(url=srv.url, concurrency=1, requests=2, output_tokens=[10]))
    assert rep.summary()["failed_requests"] == 0
    # an injected backend failure surfaces as an error
    fakes[0][0].knobs.fail_status = 500
    rep = await run_load(LoadConfig(url=srv.url, concurrency=1, requests=2, output_tokens=[4]))
    assert rep.summary()["failed_requests"] == 1 and rep.summary()["ok"] == 1
    # duration mode and a stop event
    t = time.perf_counter()
    rep = await run_load(LoadConfig(url=srv.url, concurrency=3, duration_s=0.6,
                                    output_tokens=[8]))
    assert 0.5 < time.perf_counter() - t < 5 and rep.summary()["requests"] >= 3
    stop = asyncio.Event()
    task = asyncio.create_task(run_load(LoadConfig(url=srv.url, concurrency=2, duration_s=60,
                                                   output_tokens=[8])))
    task2 = asyncio.create_task(run_load(LoadConfig(url=srv.url, concurrency=2, duration_s=60,
                                                    output_tokens=[8]), stop=stop))
    await asyncio.sleep(0.3)
    stop.set()
    rep2 = await asyncio.wait_for(task2, 10)
    assert rep2.duration_s < 5
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_explicit_specs_and_seeded(env):
    srv, fakes = env
    specs = [RequestSpec("completions", "abc", 7), RequestSpec("chat", "hi", 5),
             RequestSpec("completions", "xyz", 6, greedy=False, seed=42, temperature=0.7)]
    cfg = LoadConfig(url=srv.url, concurrency=3, requests=9, specs=specs)
    ref = await make_reference(cfg, url=fakes[1][1])
    assert len(ref) == 2  # greedy only
    rep = await run_load(cfg)
    tc = check_tokens(rep, ref)
    assert tc.ok and tc.checked == sum(r.greedy for r in rep.results)
    assert {r.tokens for r in rep.results if r.spec_key == specs[2].key} <= {6}


async def test_cli_load(env, tmp_path):
    srv, fakes = env
    ph = tmp_path / "phases.json"
    ph.write_text(json.dumps([["marker", 0.1, 0.2]]))
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relocator", "load", "--url", srv.url, "-c", "4", "-n", "16",
        "--reference-url", fakes[1][1], "--save-reference", str(tmp_path / "ref.json"),
        "--out", str(tmp_path / "rep.json"), "--png", str(tmp_path / "t.png"),
        "--phases", str(ph), "--output-tokens", "10,20", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode == 0, err.decode()
    d = json.loads(out)
    assert d["summary"]["requests"] == 16 and d["summary"]["failed_requests"] == 0
    assert d["token_check"]["ok"] and d["summary"]["tokens_lost"] == 0
    assert json.loads((tmp_path / "rep.json").read_text())["phases"] == [["marker", 0.1, 0.2]]
    assert (tmp_path / "t.png").stat().st_size > 1000
    assert "token_ids" in json.loads((tmp_path / "ref.json").read_text())
    # against the saved reference, with a failure: exit code 1
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relocator", "load", "--url", srv.url, "--model", "nope", "-n",
        "2", "--reference", str(tmp_path / "ref.json"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode == 1 and b"ok / failed" in out


async def test_one_token_comparison_for_load_and_cluster_streams():
    """The cluster load's report and the load tests count the same streams the same way: one
    token dropped mid-stream is one lost token, not a lost one plus every later one mismatched."""
    import relocator.cluster.streams as streams
    from loadtests import load

    assert load.compare_ids is streams.compare_ids
    ref = {0: streams.RequestResult(0, 0, tokens=[1, 2, 3, 4, 5], text="abcde")}
    lo = streams.Load("http://127.0.0.1:9", "m", ref, max_tokens=5)
    lo.results = [streams.RequestResult(0, 0, tokens=[1, 2, 4, 5], text="abde", times=[0.0, 1.0])]
    rep = lo.report()
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (1, 0, 0), rep
    assert rep["text_mismatched"] == 1


async def test_cluster_load_with_more_clients_than_reference_prompts_checks_what_each_sent():
    """Three clients against a two-prompt reference: each client sends the prompt it is checked
    against (client 2 once sent prompt 2 and was checked against prompt 0's reference)."""
    import relocator.cluster.streams as streams

    from relocator.router.fakeserver import Knobs

    eng, runner, url = await start_fake("fake", knobs=Knobs(token_delay_s=0.005))
    try:
        ref = await streams.reference(url, "fake", 12, 2, 2)
        lo = streams.Load(url, "fake", ref, 12, 3).start()
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, lambda: time.sleep(1.0))
        await asyncio.get_running_loop().run_in_executor(None, lo.stop)
        print(f"stop took {time.monotonic() - t0:.1f}s")
        rep = lo.report()
        assert rep["requests"] > 3 and rep["text_mismatched"] == 0 and rep["tokens_mismatched"] == 0, rep
        # every finished request of every client checked against its prompt's reference
        assert all(c["requests"] > 0 and c["verified"] >= c["requests"] - 1 for c in rep["clients"]), rep["clients"]
    finally:
        await runner.cleanup()
