"""`eyas serve` end to end on 127.0.0.1 with the official `openai` client: a toy target (tiny random
Llama, SmolLM2's tokenizer) and a drafter trained on it (tests/support/serving.py).

What must hold: chat and completions, streamed and not, give the greedy output of the engine (and
of `eyas generate`); 32 concurrent streams each get their own sequential result; malformed requests
get their documented 4xx and the server keeps serving; /metrics parses and its counters move by
exactly what the requests did; a mismatched pair (embeddings prepended as a slot) refuses to start
with the fix, and with --force starts, says so, and the watchdog fires within a few requests; a
client that leaves mid-stream frees its work; draining refuses new requests and finishes the
running one."""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from eyas.cli.main import app
from eyas.convention import CaptureSpec
from eyas.data.render import render_prompt
from eyas.engine import build_target, speculative_generate
from eyas.serve import ServeOptions, ServerThread, load_served
from tests.support.serving import broken_copy, chat, make_served_pair

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

TOKENS = 20
OPTIONS = ServeOptions(max_body_bytes=16 * 1024, watch_window=64, watch_min_rounds=16, default_max_tokens=TOKENS,
                       speculation="on")  # a lone request speculates: these tests check speculative serving


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    target, drafter, questions = make_served_pair(root)
    return root, target, drafter, questions


@pytest.fixture(scope="module")
def served(pair):
    _, target, drafter, _ = pair
    return load_served(str(target), str(drafter), tree="3", model_name="toy")


@pytest.fixture(scope="module")
def server(served):
    with ServerThread(served, OPTIONS) as t:
        yield t


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(served):
    """Greedy speculative output of the engine for a prompt of token ids, on a target of its own
    (the server's target cache belongs to the server's worker)."""
    own = build_target(served.loaded.model, CaptureSpec(served.target.spec.boundaries, served.loaded.num_blocks),
                       "auto")
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(ids: list[int], n: int = TOKENS) -> list[int]:
        key = (*ids, -n)
        if key not in cache:
            cache[key] = speculative_generate(own, served.drafter, ids, tree=served.tree, max_new_tokens=n,
                                              eos_token_ids=served.loaded.eos_ids).tokens
        return cache[key]
    return greedy


def text_of(served, tokens: list[int]) -> str:
    return served.tokenizer.decode(tokens, skip_special_tokens=True)


def metrics(server) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(server.url + "/metrics") as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_and_completion_streamed_and_not_equal_the_engines_greedy_output(served, client, reference, pair):
    q = pair[3][0]
    ids = render_prompt(chat(q), served.tokenizer).tolist()
    want = reference(ids)
    r = client.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS)
    assert r.choices[0].message.content == text_of(served, want)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    spec = r.model_extra["eyas"]
    assert spec["speculative_rounds"] >= 1 and spec["accept_length"] >= 1 and len(spec["acceptance_per_depth"]) == 3

    pieces, last = [], None
    for chunk in client.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            last = chunk
        else:
            usage = chunk.usage
    assert "".join(pieces) == text_of(served, want)
    assert last.choices[0].finish_reason == "length" and last.model_extra["eyas"]["rounds"] == spec["rounds"]
    assert usage.completion_tokens == len(want)

    prompt = "Natalia sold clips to 48 of her friends"
    pids = served.tokenizer.encode(prompt)
    want = reference(pids)
    c = client.completions.create(model="toy", prompt=prompt, temperature=0, max_tokens=TOKENS)
    assert c.choices[0].text == text_of(served, want) and c.usage.completion_tokens == len(want)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="toy", prompt=prompt, temperature=0, max_tokens=TOKENS, stream=True))
    assert streamed == text_of(served, want)
    by_ids = client.completions.create(model="toy", prompt=pids, temperature=0, max_tokens=TOKENS)
    assert by_ids.choices[0].text == c.choices[0].text


def test_greedy_chat_equals_eyas_generate(client, pair):
    _, target, drafter, questions = pair
    r = CliRunner().invoke(app, ["generate", "--target", str(target), "--draft", str(drafter), "--prompt",
                                 questions[1], "--max-new-tokens", str(TOKENS), "--tree", "3", "--json"])
    assert r.exit_code == 0, r.output
    gen = json.loads(r.stdout)
    served = client.chat.completions.create(model="toy", messages=chat(questions[1]), temperature=0,
                                            max_tokens=TOKENS)
    assert served.choices[0].message.content == gen["text"] and served.usage.completion_tokens == len(gen["tokens"])


def test_stop_sequences_seed_and_sampling(served, client, reference, pair):
    q = pair[3][2]
    full = client.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS)
    text = full.choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert len(stop) == 3
    cut = client.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS, stop=[stop])
    assert cut.choices[0].message.content == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS, stop=stop, stream=True) if ch.choices)
    assert streamed == cut.choices[0].message.content
    a, b = (client.chat.completions.create(model="toy", messages=chat(q), temperature=1.0, top_p=0.9, seed=7,
                                           max_tokens=TOKENS).choices[0].message.content for _ in range(2))
    assert a == b  # the same seed draws the same tokens


def test_32_concurrent_streams_each_get_their_sequential_result(served, client, reference, pair):
    questions = pair[3]
    prompts = [questions[i % len(questions)] + f" ({i})" for i in range(32)]
    want = [text_of(served, reference(render_prompt(chat(p), served.tokenizer).tolist())) for p in prompts]

    def stream(p: str) -> str:
        return "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
            model="toy", messages=chat(p), temperature=0, max_tokens=TOKENS, stream=True) if ch.choices)

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(stream, prompts))
    assert got == want
    assert len(set(want)) > 1  # the prompts do not all give one answer: mixed state would show


def test_malformed_requests_get_their_4xx_and_the_server_keeps_serving(server, served, client, pair):
    url = server.url + "/v1/chat/completions"
    ok = {"model": "toy", "messages": chat("hi"), "max_tokens": 2, "temperature": 0}
    cases = [
        ({**ok, "model": "gpt-4"}, 404, "model_not_found", "serves 'toy', found 'gpt-4'"),
        ({**ok, "messages": []}, 400, "empty_messages", "at least one message"),
        ({**ok, "temperature": "hot"}, 400, "invalid_type", "temperature"),
        ({**ok, "max_tokens": "5"}, 400, "invalid_type", "max_tokens"),
        ({**ok, "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
        ({**ok, "top_p": 0}, 400, "invalid_value", "top_p"),
        ({**ok, "stream": "yes"}, 400, "invalid_type", "stream"),
        ({**ok, "messages": [{"role": "user"}]}, 400, "invalid_type", "messages.0.content: required"),
        ({**ok, "messages": [{"role": "tool", "content": "x"}]}, 400, "unsupported", "messages.0.role"),
        ({**ok, "max_tokens": 10_000}, 400, "context_length_exceeded", "exceed the context of 512 tokens"),
        ({**ok, "n": 2}, 400, "unsupported", "n:"),
        ({k: v for k, v in ok.items() if k != "model"}, 400, "invalid_type", "model: required"),
    ]
    for body, status, code, words in cases:
        got, err = post(url, json.dumps(body).encode())
        assert (got, err["error"]["code"]) == (status, code), (body, err)
        assert words in err["error"]["message"], (body, err)
    assert post(url, b"{not json")[1]["error"]["code"] == "invalid_json"
    assert post(url, b"[1, 2]")[0] == 400
    big = json.dumps({**ok, "messages": chat("x" * 20_000)}).encode()
    status, err = post(url, big)
    assert (status, err["error"]["code"]) == (413, "body_too_large") and "16384" in err["error"]["message"]
    got, err = post(server.url + "/v1/completions", json.dumps({"model": "toy", "prompt": ""}).encode())
    assert (got, err["error"]["code"]) == (400, "empty_messages")
    r = client.chat.completions.create(**ok)  # still serving
    assert r.usage.completion_tokens == 2


def test_models_health_and_metrics_counters_move_by_the_right_amounts(server, served, client, pair):
    models = client.models.list()
    assert [m.id for m in models.data] == ["toy"]
    with urllib.request.urlopen(server.url + "/health") as r:
        h = json.loads(r.read())
    assert h["status"] in ("ok", "degraded") and h["forced"] is False and h["preflight"]["failures"] == []
    before = metrics(server)
    r = client.chat.completions.create(model="toy", messages=chat(pair[3][3]), temperature=0, max_tokens=TOKENS)
    after = metrics(server)
    spec = r.model_extra["eyas"]
    moved = (lambda name, labels=(): after.get((name, labels), 0.0) - before.get((name, labels), 0.0))
    assert moved("eyas_generation_tokens_total") == r.usage.completion_tokens
    assert moved("eyas_prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("eyas_spec_decode_num_drafts_total") == spec["speculative_rounds"]
    assert moved("eyas_spec_decode_num_accepted_tokens_total") == sum(spec["accepted_at_depth"])
    for p, a in enumerate(spec["accepted_at_depth"]):
        assert moved("eyas_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),)) == a
    assert moved("eyas_spec_decode_num_draft_tokens_total") == sum(spec["drafted_at_depth"])
    assert moved("eyas_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200"))) == 1
    assert moved("eyas_time_to_first_token_seconds_count") == 1 and moved("eyas_time_per_output_token_seconds_count") == 1
    assert moved("eyas_spec_accept_length_count") == spec["speculative_rounds"]
    assert after[("eyas_preflight_forced", ())] == 0
    predicted = served.prediction.acceptance
    assert after[("eyas_spec_predicted_acceptance", (("position", "0"),))] == pytest.approx(predicted[0])
    assert after[("eyas_spec_acceptance_alert", ())] == (1 if server.state.watchdog.verdict.alert else 0)
    # the healthy pair on prompts it drafts well never alerts (the shared server's window also holds
    # the first question's rounds, which the toy drafter accepts poorly: 0.19 at depth 1)
    with ServerThread(served, OPTIONS) as fresh:
        c = OpenAI(base_url=fresh.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for q in pair[3][2:6]:
            c.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS)
        assert metrics(fresh)[("eyas_spec_acceptance_alert", ())] == 0
        assert fresh.state.watchdog.verdict.status in ("ok", "low"), fresh.state.watchdog.verdict.message  # judged


def test_a_client_that_leaves_mid_stream_frees_its_work(server, served):
    before = metrics(server).get(("eyas_requests_cancelled_total", ()), 0.0)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = json.dumps({"model": "toy", "messages": chat("Count to a thousand."), "max_tokens": 400,
                       "temperature": 0, "stream": True})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first chunk arrived: the request is decoding
    conn.sock.close()  # the client goes away
    conn.close()
    deadline = time.time() + 20
    while metrics(server).get(("eyas_requests_cancelled_total", ()), 0.0) == before and time.time() < deadline:
        time.sleep(0.05)
    assert metrics(server)[("eyas_requests_cancelled_total", ())] == before + 1
    assert server.state.worker.running is None
    # the same for a client that waits for a whole (non-streamed) answer and leaves
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body.replace('"stream": true', '"stream": false'),
                 {"content-type": "application/json"})
    deadline = time.time() + 10
    while server.state.worker.running is None and time.time() < deadline:
        time.sleep(0.01)
    conn.sock.close()
    conn.close()
    deadline = time.time() + 20
    while metrics(server).get(("eyas_requests_cancelled_total", ()), 0.0) == before + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert metrics(server)[("eyas_requests_cancelled_total", ())] == before + 2


def test_mismatched_pair_refuses_to_start_with_the_fix_and_force_starts_and_the_watchdog_fires(pair, caplog):
    root, target, drafter, questions = pair
    broken = broken_copy(drafter, root / "broken")
    from eyas.serve import free_port

    port = free_port()  # the port opens while loading ("loading"), and closes again on the refusal
    r = CliRunner().invoke(app, ["serve", "--target", str(target), "--draft", str(broken), "--port", str(port)])
    assert r.exit_code == 1, r.output
    out = " ".join(r.output.split())
    assert "refusing to serve" in out and "[fingerprint_boundaries]" in out
    assert "the embeddings (boundary 0) prepended as a slot" in out
    assert f"fix: in {broken}/eyas.json set boundaries: [2, 4, 5], contract.capture.boundaries: [2, 4, 5]" in out
    assert "--force" in out

    forced = load_served(str(target), str(broken), tree="3", force=True, model_name="toy")
    assert forced.preflight.forced and [p.code for p in forced.preflight.failures] == ["fingerprint_boundaries"]
    caplog.set_level(logging.WARNING, logger="eyas.serve")
    with ServerThread(forced, OPTIONS) as t:
        c = OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with urllib.request.urlopen(t.url + "/health") as resp:
            h = json.loads(resp.read())
        assert h["forced"] is True and h["status"] == "degraded" and "--force" in h["warning"]
        assert metrics(t)[("eyas_preflight_forced", ())] == 1
        fired_after = None
        for i, q in enumerate(questions[:6]):
            c.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS)
            if t.state.watchdog.verdict.alert:
                fired_after = i + 1
                break
        assert fired_after is not None and fired_after <= 4, t.state.watchdog.verdict.message
        v = t.state.watchdog.verdict
        assert v.status == "broken" and v.ratio < 0.5
        assert metrics(t)[("eyas_spec_acceptance_alert", ())] == 1
        warned = [rec.getMessage() for rec in caplog.records if rec.name == "eyas.serve"]
        assert any("far below the training prediction" in m and f"eyas doctor --target {target} --draft {broken}" in m
                   for m in warned), warned
        with urllib.request.urlopen(t.url + "/health") as resp:
            assert json.loads(resp.read())["watchdog"]["status"] == "broken"
        # eyas watch reads eyas serve's /metrics as it reads vLLM's, and says the same
        w = CliRunner().invoke(app, ["watch", "--metrics", t.url + "/metrics", "--draft", str(broken), "--target",
                                     str(target), "--min-rounds", "16", "--json"])
        assert w.exit_code == 1, w.output
        watched = json.loads(w.stdout)
        assert watched["engine"] == "eyas" and watched["status"] == "broken"
        assert watched["doctor_command"] == v.doctor_command


def test_draining_refuses_new_requests_and_a_shutdown_finishes_the_running_one(served, pair, reference):
    with ServerThread(served, OPTIONS) as t:
        c = OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        q, n = pair[3][4], 150  # long enough to be decoding still when the shutdown comes
        stream = c.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=n, stream=True)
        chunks = iter(stream)
        first = next(chunks)  # in flight
        t.state.begin_drain()  # what SIGTERM does first
        status, err = post(t.url + "/v1/chat/completions",
                           json.dumps({"model": "toy", "messages": chat("hi"), "max_tokens": 2}).encode())
        assert (status, err["error"]["code"]) == (503, "shutting_down")
        try:
            urllib.request.urlopen(t.url + "/health")
            raise AssertionError("health answered 200 while draining")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and json.loads(e.read())["status"] == "draining"
        assert t.state.worker.running is not None  # still decoding
        t.server.handle_exit(15, None)  # SIGTERM: uvicorn stops listening, the open stream goes on
        rest = list(chunks)
        text = "".join(ch.choices[0].delta.content or "" for ch in [first, *rest] if ch.choices)
        assert first.choices[0].delta.role == "assistant" and rest[-1].choices[0].finish_reason == "length"
        assert text == text_of(served, reference(render_prompt(chat(q), served.tokenizer).tolist(), n))
        t.thread.join(30)
    assert not t.thread.is_alive() and not t.state.worker.thread.is_alive()


def load_script(name: str = "serve_load"):
    """benchmarks/NAME.py as a module."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_load_script_launches_eyas_serve_per_setting_and_each_exits_0_after_sigterm(pair, capsys, monkeypatch):
    """The command itself, as a user and an orchestrator run it: `eyas serve` launched with speculation
    auto and off, ready, loaded by clients in two forked processes, then SIGTERM: exit code 0. Both
    servers give every prompt the same greedy answer (float32)."""
    import os

    import eyas

    _, target, drafter, _ = pair
    src = str(Path(eyas.__file__).parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    from eyas.serve import free_port

    mod = load_script()
    rc = mod.main(["--target", str(target), "--draft", str(drafter), "--tree", "3", "--speculation", "auto,off",
                   "--port", str(free_port()), "--clients", "1,4", "--requests", "1", "--min-requests", "2",
                   "--max-tokens", "4", "--client-procs", "2", "--timeout", "240", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["exit_codes"] == {"auto": 0, "off": 0}
    assert "eyas.cli.main serve" in report["command"] and set(report["ready_s"]) == {"auto", "off"}
    assert [(lv["speculation"], lv["clients"], lv["client_processes"]) for lv in report["levels"]] == [
        ("auto", 1, 1), ("off", 1, 1), ("auto", 4, 2), ("off", 4, 2)]
    for lv in report["levels"]:
        # a level sends at least 2 requests (--min-requests): the lone client sends 2
        assert lv["errors"] == [] and lv["requests"] == max(2, lv["clients"])
        assert lv["completion_tokens"] == 4 * lv["requests"] and lv["greedy_mismatches"] == 0
        # what the server did in the level: its steps (a batched step or a lone round each) and no compilation on a CPU
        steps = lv["server"]["steps"]
        assert set(steps) <= {"speculative", "batched", "batched_speculative"} and 0 < sum(steps.values())
        assert lv["server"]["compile_s"] == 0 == lv["server"]["target_compile_s"]
    assert all("speculative" not in lv["server"]["steps"] for lv in report["levels"] if lv["speculation"] == "off")
    assert report["levels"][2]["x_speculation_off"] == pytest.approx(
        report["levels"][2]["throughput_tok_s"] / report["levels"][3]["throughput_tok_s"], abs=1e-3)


def test_the_overhead_script_measures_the_serving_layer_around_a_waiting_engine(pair, capsys):
    """benchmarks/serve_overhead_cpu.py: the real server around WaitBatch (a step that only waits):
    every request answered, and the ideal is rows x tokens a step / the step's wait."""
    _, target, drafter, _ = pair
    mod = load_script("serve_overhead_cpu")
    rc = mod.main(["--target", str(target), "--draft", str(drafter), "--clients", "4", "--speculation", "off,on",
                   "--mode", "in-process,engine-process", "--requests", "1", "--max-tokens", "12", "--step-ms", "5",
                   "--client-procs", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and [(r["mode"], r["speculation"]) for r in report["levels"]] == [
        ("in-process", "off"), ("in-process", "on"), ("engine-process", "off"), ("engine-process", "on")]
    for r in report["levels"]:
        assert r["errors"] == 0 and r["requests"] == 4
        assert 0 < r["of_ideal"] <= 1.05  # no server delivers more than every row its tokens at every wait
    for plain, rounds in (report["levels"][:2], report["levels"][2:]):
        assert plain["ideal_tok_s"] == pytest.approx(4 / 0.005)  # a token a row every 5 ms
        assert rounds["ideal_tok_s"] > plain["ideal_tok_s"]  # rounds: depth + 1 tokens for 1 + depth / 4 waits


def test_the_load_script_reports_every_level_and_stays_on_127_0_0_1(server, capsys):
    mod = load_script()
    rc = mod.main(["--url", server.url, "--clients", "1,3", "--requests", "2", "--max-tokens", "5",
                   "--temperatures", "0,1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and [(lv["temperature"], lv["clients"]) for lv in report["levels"]] == [(0, 1), (0, 3), (1, 1), (1, 3)]
    for lv in report["levels"]:
        assert lv["errors"] == [] and lv["requests"] == 2 * lv["clients"]
        assert lv["greedy_mismatches"] == 0  # float32: every greedy answer equals its prompt's first
        assert lv["x_speculation_off"] is None  # one server, as served
        assert lv["x_single_stream"] == pytest.approx(
            lv["throughput_tok_s"] / next(o["throughput_tok_s"] for o in report["levels"]
                                          if o["clients"] == 1 and o["temperature"] == lv["temperature"]), abs=1e-3)
        if lv["temperature"] == 0:  # greedy, the toy never stops early; a sampled answer may draw the eos
            assert lv["completion_tokens"] == 5 * lv["requests"]
        else:
            assert 0 < lv["completion_tokens"] <= 5 * lv["requests"]
        assert 0 < lv["ttft_p50_s"] <= lv["ttft_p99_s"] and 0 < lv["tpot_p50_s"] <= lv["tpot_p99_s"]
        # (wall_s is rounded to the millisecond: a few percent on a toy level that lasts tens of ms)
        assert lv["throughput_tok_s"] == pytest.approx(lv["completion_tokens"] / lv["wall_s"], rel=0.05)
    with pytest.raises(SystemExit):
        mod.main(["--url", "http://10.0.0.1:8000"])
    assert "only a server on 127.0.0.1" in capsys.readouterr().err
    assert mod.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and mod.percentile([1.0, 2.0], 99) == pytest.approx(1.99)


def test_tree_auto_picks_a_tree_on_this_hardware_and_serves_it_losslessly(pair):
    _, target, drafter, questions = pair
    auto = load_served(str(target), str(drafter), tree="auto", model_name="toy")
    own = build_target(auto.loaded.model, CaptureSpec(auto.target.spec.boundaries, auto.loaded.num_blocks), "auto")
    ids = render_prompt(chat(questions[5]), auto.tokenizer).tolist()
    want = speculative_generate(own, auto.drafter, ids, tree=auto.tree, max_new_tokens=TOKENS,
                                eos_token_ids=auto.loaded.eos_ids).tokens
    with ServerThread(auto, OPTIONS) as t:
        with urllib.request.urlopen(t.url + "/health") as r:
            assert json.loads(r.read())["tree"] == auto.tree.to_dict()
        c = OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = c.chat.completions.create(model="toy", messages=chat(questions[5]), temperature=0, max_tokens=TOKENS)
    assert got.choices[0].message.content == text_of(auto, want)


def test_a_sampled_request_is_served_with_the_sampled_tree(pair):
    """--tree for greedy requests, --tree-sampled for the rest: /health names both, and a request at
    temperature 0.8 with a seed gets exactly what the engine gives with the sampled tree and that seed
    (the tree's shape sets the acceptance's draws, so the greedy tree would give other tokens)."""
    from eyas.engine import SamplingParams, TreePlan, TreeSpec
    from eyas.serve.startup import generator_for

    _, target, drafter, questions = pair
    served = load_served(str(target), str(drafter), tree="3", tree_sampled="2,2,3", model_name="toy")
    assert served.tree == TreePlan(TreeSpec.chain(3), TreeSpec(2, 2, 3))
    own = build_target(served.loaded.model, CaptureSpec(served.target.spec.boundaries, served.loaded.num_blocks),
                       "auto")
    ids = render_prompt(chat(questions[2]), served.tokenizer).tolist()
    sampling = SamplingParams(temperature=0.8)
    want, other = (speculative_generate(own, served.drafter, ids, tree=tree, sampling=sampling, max_new_tokens=TOKENS,
                                        eos_token_ids=served.loaded.eos_ids,
                                        generator=generator_for(own.device, 7)).tokens
                   for tree in (TreeSpec(2, 2, 3), TreeSpec.chain(3)))
    with ServerThread(served, OPTIONS) as t:
        with urllib.request.urlopen(t.url + "/health") as r:
            assert json.loads(r.read())["tree"] == {"greedy": [3, 1, 3], "sampled": [2, 2, 3]}
        c = OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = c.chat.completions.create(model="toy", messages=chat(questions[2]), temperature=0.8, seed=7,
                                        max_tokens=TOKENS)
        c.close()
    assert got.choices[0].message.content == text_of(served, want)
    assert want != other  # the test tells the trees apart


def test_the_load_scripts_settings_launch_servers_with_lanes_in_process_or_as_they_are():
    flags = load_script().setting_flags
    assert flags("") == [] and flags("in-process") == ["--in-process"]
    assert flags("lanes4") == ["--lone-sessions", "4"]
    assert flags("lanes0") is None and flags("lanes") is None and flags("threads") is None
