"""`eyas serve` with its decode worker in an engine process (eyas.serve.engine_process), on the toy
pair in float32 on the CPU.

What must hold, as in one process: 8 concurrent greedy requests each get exactly their
single-request output (the steps, rows and acceptance reach /metrics and /health from the other
process); a client that leaves mid-stream frees its row while its neighbours decode; a full queue
answers 503; a shutdown lets the running request finish and the engine process exit 0. And what
is new with a second process: an engine process that dies ends the requests in flight, and every
later one, with an error naming its exit code instead of leaving them waiting."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from eyas.serve import ServeOptions, ServerThread
from eyas.serve.engine_process import EngineProcess
from eyas.serve.load_args import LoadArgs
from tests.support.serving import chat
from tests.test_serve import metrics
from tests.test_serve_batching import OPTIONS, TOKENS, alone, client, served, streamed  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]


def health(t: ServerThread) -> dict:
    with urllib.request.urlopen(t.url + "/health") as r:
        return json.loads(r.read())


def test_8_concurrent_greedy_requests_through_the_engine_process_each_get_their_single_request_output(served, alone):
    sv, questions = served
    prompts = [questions[i % len(questions)] + f" ({i})" for i in range(8)]
    want = [alone(p) for p in prompts]
    with ServerThread(LoadArgs(sv.target_name, str(sv.draft_path), tree="3", model_name="toy"), OPTIONS) as t:
        engine = t.state.worker
        assert isinstance(engine, EngineProcess) and engine.max_rows == 4 and engine.process.is_alive()
        c = client(t)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: streamed(c, p), prompts))
        m = metrics(t)
        assert engine.settled.wait(10)  # the engine went idle and sent its final state
        h = health(t)
    assert got == want and len(set(want)) > 1
    assert m[("eyas_generation_tokens_total", ())] == 8 * TOKENS
    assert m[("eyas_decode_steps_total", (("kind", "batched_speculative"),))] > 0  # steps counted over the pipe
    assert m[("eyas_spec_decode_num_accepted_tokens_total", ())] > 0
    assert h["queue"] == {"running": 0, "waiting": 0, "max_rows": 4}
    measured = sum(h["batch_speculation"]["steps"].values())  # the state as the engine went idle
    assert h["batch_speculation"]["mode"] == "on"
    assert 0 < measured <= m[("eyas_decode_steps_total", (("kind", "batched_speculative"),))]
    assert h["speculation"]["mode"] == "on"
    assert engine.process.exitcode == 0  # the shutdown drained it
    # the start-up as the engine process saw it: the loader's stages and what came around them
    seconds = h["startup"]["seconds"]
    assert set(seconds) == {"spawn", "imports", "load", "check", "compile", "worker"}
    assert all(v >= 0 for v in seconds.values()) and seconds["spawn"] > 0 and seconds["worker"] > 0
    assert h["startup"]["total_s"] == pytest.approx(sum(seconds.values()), abs=0.05)


def test_a_client_that_leaves_mid_stream_frees_its_row_in_the_engine_process(served):
    sv, questions = served
    with ServerThread(LoadArgs(sv.target_name, str(sv.draft_path), tree="3", model_name="toy"), OPTIONS) as t:
        c = client(t)
        body = json.dumps({"model": "toy", "messages": chat("Count to a thousand."), "max_tokens": 400,
                           "temperature": 0, "stream": True})
        with ThreadPoolExecutor(2) as pool:
            neighbours = [pool.submit(streamed, c, q, 300) for q in questions[:2]]
            deadline = time.time() + 30
            while health(t)["queue"]["running"] < 2 and time.time() < deadline:
                time.sleep(0.01)
            conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=30)
            conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            while b'"content"' not in resp.readline():  # the role's chunk comes first; then a token's
                pass
            assert health(t)["queue"]["running"] == 3
            conn.sock.close()  # the client goes away
            conn.close()
            while health(t)["queue"]["running"] > 2 and time.time() < deadline:
                time.sleep(0.01)
            freed_while_neighbours_ran = health(t)["queue"]["running"] == 2 and not all(f.done() for f in neighbours)
            for f in neighbours:
                f.result()
        assert freed_while_neighbours_ran
        assert metrics(t)[("eyas_requests_cancelled_total", ())] == 1


def test_an_engine_process_that_dies_ends_every_request_with_its_exit_code(served):
    sv, questions = served
    options = replace(OPTIONS, default_max_tokens=400)
    with ServerThread(LoadArgs(sv.target_name, str(sv.draft_path), tree="3", model_name="toy"), options) as t:
        engine = t.state.worker
        conn = http.client.HTTPConnection("127.0.0.1", t.port, timeout=30)
        conn.request("POST", "/v1/chat/completions", json.dumps({"model": "toy", "messages": chat(questions[0]),
                                                                 "temperature": 0, "stream": True}),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        while b'"content"' not in resp.readline():  # decoding
            pass
        os.kill(engine.process.pid, signal.SIGKILL)
        rest = resp.read().decode()
        assert "engine_error" in rest and "exited with code -9" in rest and "restart eyas serve" in rest
        assert rest.rstrip().endswith("data: [DONE]")
        later = urllib.request.Request(t.url + "/v1/chat/completions", headers={"content-type": "application/json"},
                                       data=json.dumps({"model": "toy", "messages": chat("Hi")}).encode())
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(later)
        assert e.value.code == 500 and "exited with code -9" in json.loads(e.value.read())["error"]["message"]
        assert health(t)["queue"]["running"] == 0


def test_a_full_queue_answers_503_and_a_shutdown_finishes_the_running_request(served):
    sv, questions = served
    options = ServeOptions(max_rows=2, max_queue=1, default_max_tokens=60, retry_after_s=2)
    t = ServerThread(LoadArgs(sv.target_name, str(sv.draft_path), tree="3", model_name="toy"), options).start()
    engine = t.state.worker

    def post(i: int) -> int:
        body = json.dumps({"model": "toy", "messages": chat(questions[i % 6]), "temperature": 0}).encode()
        req = urllib.request.Request(t.url + "/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req) as r:
                return json.loads(r.read())["usage"]["completion_tokens"]
        except urllib.error.HTTPError as e:
            assert e.headers.get("retry-after") == "2" and json.loads(e.read())["error"]["code"] == "queue_full"
            return e.code

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(post, range(12)))
    assert 503 in answers and 60 in answers and set(answers) == {503, 60}
    c = client(t)
    stream = iter(c.chat.completions.create(model="toy", messages=chat(questions[4]), temperature=0, max_tokens=150,
                                            stream=True))
    text = next(stream).choices[0].delta.content or ""
    t.stop()  # drains: the request decoding finishes
    text += "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert engine.process.exitcode == 0 and len(text) > 50
