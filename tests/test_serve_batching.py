"""`eyas serve` with continuous batching (eyas.serve.batching) on the toy pair, float32 on the CPU.

What must hold: 8 concurrent greedy requests each get exactly their single-request output, decoded
in one running batch (the batched steps and the busy rows show in /metrics); a request decoding
speculatively alone joins the batch when others arrive and still gets its own output; greedy rows
beside sampled ones keep theirs; a client that leaves mid-stream frees its row at once; a full
queue answers 503 with Retry-After; --max-rows 1 serves one request at a time (the FIFO worker)."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
from dataclasses import replace
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from eyas.convention import CaptureSpec
from eyas.data.render import render_prompt
from eyas.engine import build_target, speculative_generate
from eyas.serve import ServeOptions, ServerThread, load_served
from eyas.serve.batching import BatchWorker
from eyas.serve.worker import DecodeWorker
from tests.support.serving import chat, make_served_pair
from tests.test_serve import metrics

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

TOKENS = 24
OPTIONS = ServeOptions(max_rows=4, default_max_tokens=TOKENS, watch_window=64, watch_min_rounds=16, speculation="on")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    target, drafter, questions = make_served_pair(tmp_path_factory.mktemp("batching"))
    return load_served(str(target), str(drafter), tree="3", model_name="toy"), questions


@pytest.fixture(scope="module")
def alone(served):
    """Greedy output of a request alone: the engine's speculative decoding on a target of its own."""
    sv, _ = served
    own = build_target(sv.loaded.model, CaptureSpec(sv.target.spec.boundaries, sv.loaded.num_blocks), "auto")

    def greedy(question: str, n: int = TOKENS) -> str:
        ids = render_prompt(chat(question), sv.tokenizer).tolist()
        out = speculative_generate(own, sv.drafter, ids, tree=sv.tree, max_new_tokens=n,
                                   eos_token_ids=sv.loaded.eos_ids).tokens
        return sv.tokenizer.decode(out, skip_special_tokens=True)
    return greedy


def client(t: ServerThread) -> OpenAI:
    return OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def streamed(c: OpenAI, question: str, n: int = TOKENS, **kw) -> str:
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="toy", messages=chat(question), temperature=0, max_tokens=n, stream=True, **kw) if ch.choices)


@pytest.mark.parametrize("speculation", ["on", "off", "auto"])
def test_8_concurrent_greedy_requests_each_get_their_single_request_output_from_one_batch(served, alone, speculation):
    """``on``: the batch runs speculative rounds (a chain or a tree a row, each row its own accepted length);
    ``off``: plain batched steps; ``auto``: a request alone may speculate, a batch steps plainly
    (``--batch-speculation`` off unless asked). Either way each request gets its output alone."""
    sv, questions = served
    prompts = [questions[i % len(questions)] + f" ({i})" for i in range(8)]
    want = [alone(p) for p in prompts]
    with ServerThread(sv, replace(OPTIONS, speculation=speculation)) as t:
        assert isinstance(t.state.worker, BatchWorker) and t.state.worker.max_rows == 4
        steps: list[tuple[str, int, int]] = []
        drafts: list[int | None] = []  # verified a row: a tree's nodes (None: a lone request's round)
        step = t.state.worker.on_step
        t.state.worker.on_step = lambda kind, rows, depth, *rest: (steps.append((kind, rows, depth)),
                                                                   drafts.append(rest[0] if rest else None),
                                                                   step(kind, rows, depth, *rest))
        c = client(t)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: streamed(c, p), prompts))
        m = metrics(t)
        with urllib.request.urlopen(t.url + "/health") as r:
            health = json.loads(r.read())
    assert got == want and len(set(want)) > 1
    kinds = {kind for kind, _, _ in steps}
    if speculation == "on":  # a request alone at the start may run its own rounds first
        assert "batched_speculative" in kinds and kinds <= {"batched_speculative", "speculative"}
    elif speculation == "auto":
        assert "batched" in kinds and kinds <= {"batched", "speculative"}
    else:
        assert kinds == {"batched"}
    batched = [(kind, rows, depth) for kind, rows, depth in steps if kind.startswith("batched")]
    assert max(rows for _, rows, _ in batched) == 4  # the batch was full at some step
    for kind in ("speculative", "batched", "batched_speculative"):
        assert m[("eyas_decode_steps_total", (("kind", kind),))] == sum(k == kind for k, _, _ in steps)
    assert m[("eyas_batch_rows", ())] == steps[-1][1]
    assert m[("eyas_batch_speculation_depth", ())] == batched[-1][2]
    assert all((depth > 0) == (kind == "batched_speculative") for kind, _, depth in batched)
    assert m[("eyas_generation_tokens_total", ())] == 8 * TOKENS  # the toy never stops early
    assert health["queue"] == {"running": 0, "waiting": 0, "max_rows": 4}
    chosen = health["batch_speculation"]  # each measured rate with its steps (those that compiled: not counted)
    assert set(chosen["steps"]) == set(chosen["tokens_per_s"]) and 0 < sum(chosen["steps"].values()) <= len(batched)
    assert chosen["compile_s"] >= 0 and chosen["mode"] == {"auto": "off"}.get(speculation, speculation)
    if speculation == "on":  # rounds of the batch counted in the acceptance metrics, per depth chosen
        assert m[("eyas_spec_decode_num_drafts_total", ())] >= sum(rows for k, rows, _ in batched)
        assert m[("eyas_spec_decode_num_accepted_tokens_total", ())] > 0
        assert any(key.startswith("4+/greedy/") for key in health["batch_speculation"]["tokens_per_s"])
        # greedy batches try trees beside chains (the middle arm first: tree 3,4,12 verifies 12 a row)
        assert any(d is not None and d > depth for (_, _, depth), d in zip(steps, drafts))
        assert m[("eyas_batch_speculation_drafts", ())] == [d for d in drafts if d is not None][-1]


def test_a_request_decoding_alone_joins_the_batch_when_others_arrive_and_keeps_its_output(served, alone):
    sv, questions = served
    long_q, n = questions[4], 120
    with ServerThread(sv, OPTIONS) as t:
        c = client(t)
        kinds: list[str] = []
        step = t.state.worker.on_step
        t.state.worker.on_step = lambda kind, rows, depth, *rest: kinds.append(kind) or step(kind, rows, depth, *rest)
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(streamed, c, long_q, n)
            deadline = time.time() + 20
            while "speculative" not in kinds and time.time() < deadline:  # decoding alone, speculatively
                time.sleep(0.005)
            others = [pool.submit(streamed, c, q) for q in questions[1:4]]
            got_first, got_others = first.result(), [f.result() for f in others]
    assert "speculative" in kinds and "batched_speculative" in kinds
    assert kinds.index("speculative") < kinds.index("batched_speculative")
    assert got_first == alone(long_q, n)
    assert got_others == [alone(q) for q in questions[1:4]]


def test_lone_sessions_decode_side_by_side_on_their_lanes_until_more_arrive_than_lanes(served, alone):
    """--lone-sessions 3: three requests at once each decode alone on a lane of their own (twins of
    the fast target), no batched step; seven at once are more than the lanes, so the batch takes
    them. Every greedy output is the request's single-request output either way."""
    sv, questions = served
    with ServerThread(sv, replace(OPTIONS, lone_sessions=3)) as t:
        worker = t.state.worker
        lanes = worker.lanes
        assert len(lanes) == 3 and lanes[0].target is sv.target and all(lane.ready for lane in lanes)
        assert len({id(lane.target) for lane in lanes}) == 3 and worker.batch_report()["lanes_ready"] == 3
        c = client(t)
        kinds: list[str] = []
        most = [0]
        step = worker.on_step

        def seen(kind, rows, depth, *rest):
            kinds.append(kind)
            most[0] = max(most[0], len(worker.solos))
            step(kind, rows, depth, *rest)
        worker.on_step = seen
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda q: streamed(c, q), questions[:3]))
        assert got == [alone(q) for q in questions[:3]]
        assert set(kinds) == {"speculative"} and most[0] >= 2, (set(kinds), most)
        kinds.clear()
        with ThreadPoolExecutor(7) as pool:
            got = list(pool.map(lambda q: streamed(c, q), questions[:7]))
        assert got == [alone(q) for q in questions[:7]]
        assert "batched" in kinds or "batched_speculative" in kinds
        # what --speculation auto weighs at several requests in flight: the lanes' passes and the batch's steps
        rates = worker.policy.to_dict()["in_flight_tokens_per_s"]
        assert "2+/greedy/speculative" in rates and any(k.endswith("/greedy/row") for k in rates), rates


def test_make_lanes_builds_twins_of_the_target_and_refuses_fewer_than_one(served):
    from eyas.serve.lanes import make_lanes

    sv, _ = served
    lanes, warmups = make_lanes(sv, 2, 64)
    assert lanes[0].target is sv.target and lanes[1].target is not sv.target
    assert lanes[1].target.spec == sv.target.spec and lanes[1].target.max_length == sv.target.max_length
    assert warmups == [] and all(lane.ready and lane.stream is None for lane in lanes)  # a CPU: nothing to warm
    with pytest.raises(ValueError, match="--lone-sessions: expected at least 1, found 0"):
        make_lanes(sv, 0, 64)
    # what a GPU's lane runs while the server is idle: its steps, then its drafter state's rounds
    from eyas.engine.speculative import draft_states
    from eyas.serve.lanes import _warm

    lanes[1].ready = False
    _warm(lanes[1], sv, 64, None)
    assert lanes[1].ready and len(draft_states(lanes[1].target)) >= 1  # its drafter state made, rounds run


def test_greedy_rows_beside_sampled_rows_keep_their_output(served, alone):
    sv, questions = served
    with ServerThread(sv, OPTIONS) as t:
        c = client(t)

        def sampled(q: str) -> str:
            return c.chat.completions.create(model="toy", messages=chat(q), temperature=1.0, top_p=0.9, seed=3,
                                             max_tokens=TOKENS).choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            hot = [pool.submit(sampled, q) for q in questions[:2]]
            cold = [pool.submit(streamed, c, q) for q in questions[2:4]]
            got = [f.result() for f in cold]
            assert all(isinstance(f.result(), str) for f in hot)
    assert got == [alone(q) for q in questions[2:4]]


def test_256_concurrent_streaming_clients_are_all_answered_each_with_its_own_output(served, alone):
    """None lost, none mixed: 256 clients at once (16 prompts, 16 clients each) on 8 rows and a queue
    of 256, greedy and sampled interleaved; every greedy stream is its prompt's answer alone (a
    sampled one's tokens depend on the rounds its row took: lossless in distribution only)."""
    sv, questions = served
    prompts = [questions[i % 16] + f" [{i % 16}]" for i in range(256)]
    want = {p: alone(p, 8) for p in set(prompts)}
    options = replace(OPTIONS, max_rows=8, max_queue=256)
    with ServerThread(sv, options) as t:
        c = OpenAI(base_url=t.url + "/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(i: int) -> tuple[int, str]:
            hot = dict(temperature=1.0, seed=i % 16) if i % 2 else {}
            return i, "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                model="toy", messages=chat(prompts[i]), max_tokens=8, stream=True,
                **(hot or {"temperature": 0})) if ch.choices)

        with ThreadPoolExecutor(256) as pool:
            got = dict(pool.map(ask, range(256)))
        m = metrics(t)
    assert len(got) == 256
    assert all(got[i] == want[prompts[i]] for i in range(0, 256, 2))  # greedy: each its own answer
    assert all(got[i] for i in range(1, 256, 2))
    assert m[("eyas_generation_tokens_total", ())] == 256 * 8 and m[("eyas_requests_running", ())] == 0


def test_a_client_that_leaves_mid_stream_frees_its_row_at_once(served):
    sv, questions = served
    with ServerThread(sv, OPTIONS) as t:
        c, w = client(t), t.state.worker
        body = json.dumps({"model": "toy", "messages": chat("Count to a thousand."), "max_tokens": 400,
                           "temperature": 0, "stream": True})
        with ThreadPoolExecutor(2) as pool:
            # two long neighbours keep the batch running (the leaver is in a row, not alone)
            neighbours = [pool.submit(streamed, c, q, 300) for q in questions[:2]]
            deadline = time.time() + 20
            while len(w.rows) < 2 and time.time() < deadline:
                time.sleep(0.005)
            conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=30)
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            while len(w.rows) < 3 and time.time() < deadline:
                time.sleep(0.005)
            assert len(w.rows) == 3
            resp.readline()
            conn.sock.close()  # the client goes away
            conn.close()
            deadline = time.time() + 20
            while len(w.rows) > 2 and time.time() < deadline:
                time.sleep(0.005)
            freed_while_neighbours_ran = len(w.rows) == 2 and not all(f.done() for f in neighbours)
            for f in neighbours:
                f.result()
        assert freed_while_neighbours_ran
        assert metrics(t)[("eyas_requests_cancelled_total", ())] == 1
        assert w.batch.busy == [] and w.running is None


def test_a_full_queue_answers_503_with_retry_after(served):
    sv, questions = served
    options = ServeOptions(max_rows=2, max_queue=1, default_max_tokens=60, retry_after_s=2)
    with ServerThread(sv, options) as t:
        def post(i: int) -> tuple[int, str | None, dict]:
            body = json.dumps({"model": "toy", "messages": chat(questions[i % 6]), "temperature": 0}).encode()
            req = urllib.request.Request(t.url + "/v1/chat/completions", data=body,
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req) as r:
                    return r.status, None, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("retry-after"), json.loads(e.read())

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(post, range(12)))
    refused = [a for a in answers if a[0] == 503]
    served_ok = [a for a in answers if a[0] == 200]
    assert refused and served_ok and len(refused) + len(served_ok) == 12
    for _, retry_after, body in refused:
        assert retry_after == "2" and body["error"]["code"] == "queue_full"
        assert "retry after 2 s" in body["error"]["message"]
    assert all(a[2]["usage"]["completion_tokens"] == 60 for a in served_ok)


def test_max_rows_1_serves_one_request_at_a_time(served, alone):
    sv, questions = served
    with ServerThread(sv, ServeOptions(max_rows=1, default_max_tokens=TOKENS)) as t:
        assert isinstance(t.state.worker, DecodeWorker) and t.state.worker.max_rows == 1
        c = client(t)
        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda q: streamed(c, q), questions[:3]))
    assert got == [alone(q) for q in questions[:3]]


def test_the_port_answers_loading_until_the_pair_is_ready_and_health_reports_the_startup(served):
    import threading

    from eyas.serve import ServeState, free_port, make_loading_server, serve_forever

    sv, questions = served
    port = free_port()
    server, loading = make_loading_server("127.0.0.1", port, graceful_timeout=5, log_level="warning")
    server.install_signal_handlers = lambda: None  # not the main thread
    thread = threading.Thread(target=serve_forever, args=(server,), daemon=True)
    thread.start()
    try:
        deadline = time.time() + 20
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        loading.step = "checking the drafter"
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(url + "/health")
        body = json.loads(health.value.read())
        assert health.value.code == 503 and body["status"] == "loading" and body["step"] == "checking the drafter"
        req = urllib.request.Request(url + "/v1/chat/completions", data=b"{}", headers={"content-type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as post:
            urllib.request.urlopen(req)
        assert post.value.code == 503 and post.value.headers["retry-after"] == "5"
        assert json.loads(post.value.read())["error"]["code"] == "loading"
        server.ready(ServeState(sv, OPTIONS))
        with urllib.request.urlopen(url + "/health") as r:
            h = json.loads(r.read())
        assert h["status"] in ("ok", "degraded") and h["queue"] == {"running": 0, "waiting": 0, "max_rows": 4}
        assert set(h["startup"]["seconds"]) == {"load", "check", "compile"} and h["startup"]["total_s"] > 0
        assert h["startup"]["compile_cache"] and isinstance(h["startup"]["warm_cache"], bool)
        c = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert c.chat.completions.create(model="toy", messages=chat(questions[2]), temperature=0,
                                         max_tokens=3).usage.completion_tokens == 3
    finally:
        server.handle_exit(15, None)
        thread.join(30)
    assert not thread.is_alive()


def test_speculation_auto_measures_both_paths_of_a_lone_request_and_takes_the_faster(served, alone):
    sv, questions = served
    with ServerThread(sv, ServeOptions(max_rows=4, default_max_tokens=TOKENS)) as t:
        c, policy = client(t), t.state.worker.policy
        assert policy.mode == "auto"

        def ask(q: str) -> dict:
            r = c.chat.completions.create(model="toy", messages=chat(q), temperature=0, max_tokens=TOKENS)
            assert r.choices[0].message.content == alone(q)  # either path: the same greedy output
            return r.model_extra["eyas"]

        kinds: list[str] = []
        step = t.state.worker.on_step
        t.state.worker.on_step = lambda kind, rows, depth, *rest: kinds.append(kind) or step(kind, rows, depth, *rest)

        def path(q: str) -> str:
            kinds.clear()
            ask(q)
            if set(kinds) == {"speculative"}:
                return "speculative"
            assert set(kinds) <= {"batched", "batched_speculative"}, kinds  # a row: the batch's steps only
            return "row"

        assert path(questions[2]) == "speculative"  # nothing measured: speculation first
        assert path(questions[3]) == "row"  # the batch's row, not measured yet: tried
        rates = policy.to_dict()["tokens_per_s"]
        assert rates["greedy/speculative"] > 0 and rates["greedy/row"] > 0 and rates["sampled/speculative"] is None
        faster_is_speculation = policy.rates[("greedy", "speculative")].per_s >= policy.rates[("greedy", "row")].per_s * 1.02
        assert (path(questions[4]) == "speculative") == faster_is_speculation
        with urllib.request.urlopen(t.url + "/health") as r:
            assert json.loads(r.read())["speculation"]["mode"] == "auto"
        m = metrics(t)
        assert m[("eyas_lone_request_tokens_per_second", (("kind", "greedy"), ("path", "row")))] > 0


@pytest.mark.parametrize("max_rows", [4, 1], ids=["batch-worker", "decode-worker"])
def test_deferred_startup_work_runs_while_idle_in_order_and_a_failure_only_warns(served, alone, max_rows,
                                                                                   monkeypatch):
    """A warm start leaves compilations no short request needs to the worker (Served.deferred):
    each runs on the decode thread after QUIET_BEFORE_DEFERRED_S without a request, in order; one
    that fails warns and the rest still run; requests are answered as before, and /health counts
    what was deferred."""
    import threading

    from eyas.serve import worker as worker_module

    monkeypatch.setattr(worker_module, "QUIET_BEFORE_DEFERRED_S", 0.3)
    sv, questions = served
    ran: list[tuple[int, str, float]] = []

    def unit(i: int):
        def run() -> None:
            ran.append((i, threading.current_thread().name, time.perf_counter()))
            if i == 1:
                raise RuntimeError("no compiler")
        return run

    deferred = [unit(i) for i in range(3)]
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match="a deferred start-up compilation failed .RuntimeError: no compiler"):
        with ServerThread(replace(sv, deferred=deferred, startup=replace(sv.startup, deferred=3)),
                          replace(OPTIONS, max_rows=max_rows)) as t:
            deadline = time.time() + 30
            while len(ran) < 3 and time.time() < deadline:
                time.sleep(0.02)
            assert [(i, name) for i, name, _ in ran] == [(0, "eyas-decode"), (1, "eyas-decode"), (2, "eyas-decode")]
            # each waited for its quiet window: the worker was idle from the start
            assert ran[0][2] - t0 >= 0.3 and ran[1][2] - ran[0][2] >= 0.3 and ran[2][2] - ran[1][2] >= 0.3
            assert t.state.worker.deferred == [] and sv.deferred == []  # the worker's own list
            with urllib.request.urlopen(t.url + "/health") as r:
                assert json.loads(r.read())["startup"]["deferred"] == 3
            assert streamed(client(t), questions[0]) == alone(questions[0])


def test_a_warm_start_compiles_the_verification_buckets_of_its_trees_and_the_largest():
    """Before a warm server is ready: the token bucket each tree verifies in (its drafts and the
    root) and the largest, which a shorter step pads to until the background compiled its own."""
    from eyas.engine import TreePlan
    from eyas.serve.startup import start_buckets

    buckets = (1, 8, 16, 32, 64, 128)
    assert start_buckets(buckets, TreePlan.parse("4,8,15")) == [16, 128]  # 16 tokens a round
    assert start_buckets(buckets, TreePlan.parse("3", "6,10,60")) == [8, 64, 128]  # a chain of 3, a tree of 60
    assert start_buckets(buckets, None) == [128]  # --tree auto: its timings compile what they use
    assert start_buckets(buckets, TreePlan.parse("8,16,200")) == [128]  # past the largest: verified unpadded


def test_a_compiling_batch_prepares_its_step_shapes_then_its_round_shapes_while_idle(served, monkeypatch):
    """A batch whose engine compiles (a GPU's; here torch.compile's aot_eager on the CPU) defers its
    shapes to the worker's idle time: the widest plain step first, then every plain step of contexts
    up to START_CONTEXT, then the rounds of batches up to the policy's max_rows; once idle long
    enough, every one of them runs without compiling (on the decode thread)."""
    from eyas.engine.batched import BatchedLlama
    from eyas.engine.continuous import RowBatch
    from eyas.serve import worker as worker_module
    from eyas.serve.startup import START_CONTEXT

    monkeypatch.setattr(worker_module, "QUIET_BEFORE_DEFERRED_S", 0.01)
    sv, _ = served
    engine = BatchedLlama(sv.loaded.model, rows=4, compile=True, backend="aot_eager")
    batch = RowBatch(engine, capacity=200, eos_ids=sv.loaded.eos_ids, drafter=sv.drafter,
                     boundaries=sv.target.spec.boundaries)
    worker = BatchWorker(replace(sv, deferred=[]), batch, speculation="auto", batch_speculation="auto",
                         batch_max_rows=2)
    try:
        widest = (engine.buckets()[-1], "top_p", 4)
        steps = batch.step_shapes(START_CONTEXT)
        p = worker.batch_policy
        rounds = (batch.round_shapes(START_CONTEXT, p.drafts("greedy"), 2, modes=["greedy"])
                  + batch.round_shapes(START_CONTEXT, p.drafts("sampled"), 2, modes=["sample"]))
        assert rounds and {n for n, *_ in rounds} == {1, 2}  # batches of up to max_rows busy rows
        assert {d for _, d, *_ in rounds} >= set(p.trees)  # the greedy batches' trees too

        def done() -> bool:
            return not worker.deferred and engine.prepared(*widest) and all(engine.prepared(*s) for s in steps) \
                and all(batch.spec.prepared(*shape) for shape in rounds)
        deadline = time.time() + 300
        while not done() and time.time() < deadline:
            time.sleep(0.05)
        assert done() and worker.batch_report()["deferred_left"] == 0
    finally:
        worker.stop()
