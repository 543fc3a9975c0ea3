"""The serve stage on smoke's base model: registry versions through the pipeline, then a real Ray Serve LLM
server (fetched back from the registry) answering the official `openai` client, concurrent load and
malformed requests; and `python -m pipeline batch-infer` on the registered model."""

from __future__ import annotations

import json
import re
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest
from rich.console import Console

from conftest import SMOKE, run_cli, smoke_config

# The costly starts this module makes (tests/helpers/starts.py; docs/development.md, "Start-up allowance").
STARTS = {"pipelines": 3, "ray": 2, "vllm_engines": 1, "serve_deployments": 2}

pytestmark = pytest.mark.slow

# Library output (Ray's, Ray Data's, Serve's, vLLM's, MLflow's), which belongs in the command's log, not on its console
LIBRARY = re.compile(r"\bINFO\b|\bWARNING\b|pid=\d+|Triton|Running Dataset|\d+%\|")
KEY = "test-key-123"
PORT = 18437
REGISTER = ["stages.serve.source=base_model", "stages.serve.deploy=false"]
ADAPTER = "tuned"


@pytest.fixture(scope="module")
def registered(smoke_upstream, tmp_path_factory, tracking_uri):
    """Three pipeline runs of the serve stage (register only); returns (run_dir, [registry info per run])."""
    from pipeline.runner import run_pipeline

    run_dir = smoke_upstream(tmp_path_factory.mktemp("serve"))
    infos = []
    for overrides, only in ((REGISTER, ["serve"]),
                            ([*REGISTER, "stages.serve.smoke.requests=3"], ["serve"]),  # serve reruns, same model
                            ([*REGISTER, "model.builtin.intermediate_size=96"], ["model", "serve"])):  # a new model
        cfg = smoke_config(run_dir, f"mlflow.tracking_uri={tracking_uri}", *overrides)
        summary = run_pipeline(cfg, SMOKE, Console(quiet=True), only=only)
        assert next(p for p in summary["plan"] if p.spec.name == "serve").status == "miss"
        infos.append({**summary["stages"]["serve"]["metrics"], "run_id": summary["run_ids"]["serve"]})
    return run_dir, infos


def test_unchanged_model_adds_no_version_and_a_changed_one_moves_the_alias(registered, tracking_uri):
    from mlflow.tracking import MlflowClient

    _, infos = registered
    assert [(i["registered_version"], i["new_version"]) for i in infos] == [(1, 1), (1, 0), (2, 1)]
    client = MlflowClient(tracking_uri)
    assert len(client.search_model_versions("name = 'posttrain-policy'")) == 2
    champion = client.get_model_version_by_alias("posttrain-policy", "champion")
    assert int(champion.version) == 2 and champion.run_id == infos[2]["run_id"]
    assert champion.tags["source"] == "base_model" and champion.tags["source_cache_key"]


@pytest.fixture(scope="module")
def champion(registered, tracking_uri, tmp_path_factory):
    """The champion version fetched by its registry URI, and a LoRA adapter on it (PEFT, saved as
    training saves one, with random weights in both factors so it changes the answers): (model, adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    from stages.common import lora
    from stages.common.model_registry import fetch

    model_dir = fetch("models:/posttrain-policy@champion", tracking_uri, tmp_path_factory.mktemp("registry_cache"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    wrapped = lora.wrap(model, lora.LoraSection(r=8, alpha=16), "causal")
    with torch.no_grad():  # as training moves them: B starts at zero, which would change nothing
        for p in wrapped.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.5)
    adapter = tmp_path_factory.mktemp("adapters") / ADAPTER
    lora.save_adapter(wrapped, adapter)
    return model_dir, adapter


@pytest.fixture(scope="module")
def server(registered, champion, ray_local, monkeypatch_module):
    """The champion served with an API key, and an adapter on it as `<model>:tuned`, for the module."""
    from stages.serve.app import Server

    run_dir, _ = registered
    model_dir, adapter = champion
    monkeypatch_module.setenv("SERVE_TEST_KEY", KEY)
    cfg = smoke_config(run_dir, f"stages.serve.http.port={PORT}", "stages.serve.http.api_key_env=SERVE_TEST_KEY",
                       "stages.serve.engine.max_num_seqs=16", "stages.serve.limits.max_tokens=32",
                       # float32 as HF computes (auto would downcast to bf16 on CPU): the adapter test compares tokens
                       "stages.serve.engine.dtype=float32").stages.serve
    # Someone else's application already runs on this Ray instance, on another route prefix: the
    # stage's server must leave it (and Serve) running when it goes (checked after it has gone).
    from ray import serve

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Bystander:
        def __call__(self, request) -> str:
            return "still here"

    serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
    serve.run(Bystander.bind(), name="bystander", route_prefix="/bystander")
    try:
        with Server(cfg, model_dir, print, adapters={ADAPTER: adapter}) as url:
            yield url, cfg.served_name()
        assert serve.status().applications["bystander"].status == "RUNNING"  # not deleted with ours
        assert "posttrain" not in serve.status().applications  # ours is gone
        import httpx

        assert httpx.get(f"{url}/bystander", timeout=30).text == "still here"  # Serve itself still runs
    finally:
        serve.shutdown()  # this fixture started Serve


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _client(url, key=KEY):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_openai_client_chat_completion_and_streaming(server):
    url, model = server
    client = _client(url)
    assert [m.id for m in client.models.list().data] == [model, f"{model}:{ADAPTER}"]

    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                          max_tokens=8, temperature=0.0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0

    text = client.completions.create(model=model, prompt="Calculate 4 + 1.", max_tokens=8, temperature=0.0)
    assert text.usage.completion_tokens > 0 and isinstance(text.choices[0].text, str)

    # Streamed greedy text is the same text, arriving in several chunks.
    chunks = [c.choices[0].text for c in client.completions.create(model=model, prompt="Calculate 4 + 1.", max_tokens=8,
                                                                   temperature=0.0, stream=True) if c.choices]
    assert len(chunks) > 1 and "".join(chunks) == text.choices[0].text
    streamed_chat = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}], max_tokens=8, temperature=0.0,
        stream=True) if c.choices]
    assert "".join(streamed_chat) == chat.choices[0].message.content

    # A chat request naming no max_tokens: the server's limit (32 here), not the rest of the context
    # (128 - prompt). (The legacy completions API has its own default of 16, from OpenAI's spec.)
    unnamed = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                             temperature=0.0, extra_body={"ignore_eos": True})
    assert unnamed.usage.completion_tokens == 32 and unnamed.choices[0].finish_reason == "length"


@pytest.mark.tier("e2e", covers=("stages/serve/", "stages/common/lora.py", "stages/common/serving.py",
                                 "pipeline/upstream/"))
def test_a_lora_adapter_answers_under_its_own_name_as_its_merged_model_does(server, champion, tmp_path):
    """`<model>:tuned` is the adapter on the base (Serve LLM's multiplexing, vLLM's LoRA): its greedy
    tokens are those of HF generate on the base with the adapter merged; the base still answers as
    the base; an adapter the server does not have is a 404 naming the ones it has."""
    import openai

    from stages.common import lora
    from stages.common.models import greedy_generate, load_tokenizer

    url, model = server
    model_dir, adapter = champion
    client = _client(url)
    prompt = load_tokenizer(model_dir)("Calculate 4 + 1.")["input_ids"]

    def answer(name: str) -> str:
        """The completion's tokens, decoded whole (the streamed text holds back a token that ends
        mid-character, and this random adapter answers in byte tokens)."""
        choice = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0,
                                           extra_body={"return_token_ids": True}).choices[0]
        return load_tokenizer(model_dir).decode(choice.token_ids, skip_special_tokens=True)

    merged = lora.merge_into(model_dir, adapter, "causal", tmp_path / "merged")
    load_tokenizer(model_dir).save_pretrained(merged)
    [expected], _ = greedy_generate(merged, [prompt], 8)
    [base_expected], _ = greedy_generate(model_dir, [prompt], 8)
    assert expected != base_expected  # the adapter changes the answer, so the comparison means something
    assert answer(f"{model}:{ADAPTER}") == expected
    assert answer(model) == base_expected
    with pytest.raises(openai.NotFoundError, match=f"this server has: {model}, {model}:{ADAPTER}"):
        answer(f"{model}:other")


def test_sixteen_concurrent_requests_all_succeed(server):
    url, model = server
    client = _client(url)

    def one(i):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"What is {i} + 1?"}],
                                           max_tokens=6, temperature=0.0)
        return r.usage.completion_tokens

    with ThreadPoolExecutor(16) as pool:
        tokens = list(pool.map(one, range(16)))
    assert len(tokens) == 16 and all(t > 0 for t in tokens)


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server):
    import httpx

    url, model = server
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        def post(path, body, headers=auth, **kw):
            return http.post(path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                             headers={"content-type": "application/json", **headers}, **kw)

        good = {"model": model, "prompt": "Calculate 1 + 1.", "max_tokens": 4}
        cases = {
            "no key": post("/v1/completions", good, headers={}),
            "wrong key": post("/v1/completions", good, headers={"Authorization": "Bearer nope"}),
            "bad JSON": post("/v1/completions", b'{"model": '),
            "non-JSON as text/plain": http.post("/v1/completions", content=b"hello",
                                                headers={**auth, "content-type": "text/plain"}),
            "unknown model": post("/v1/completions", {**good, "model": "no-such-model"}),
            "negative max_tokens": post("/v1/chat/completions", {"model": model, "max_tokens": -5,
                                                                 "messages": [{"role": "user", "content": "hi"}]}),
            "prompt longer than the context": post("/v1/completions", {**good, "prompt": "1 + 1 " * 400}),
            "max_tokens above the limit": post("/v1/completions", {**good, "max_tokens": 33}),
            "n as a string": post("/v1/completions", {**good, "n": "64"}),
            "n as a float": post("/v1/completions", {**good, "n": 1e4}),
            "body above the size limit": post("/v1/completions", {**good, "prompt": "x" * (2 << 20)}),
        }
        statuses = {name: r.status_code for name, r in cases.items()}
        assert statuses == {"no key": 401, "wrong key": 401, "bad JSON": 400, "non-JSON as text/plain": 400,
                            "unknown model": 404, "negative max_tokens": 400, "prompt longer than the context": 400,
                            "max_tokens above the limit": 400, "n as a string": 400, "n as a float": 400,
                            "body above the size limit": 413}
        assert "max_tokens" in cases["negative max_tokens"].text and \
            "context length" in cases["prompt longer than the context"].text
        after = post("/v1/completions", good)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] > 0
        assert http.get("/-/healthz").status_code == 200  # health needs no key


def test_requests_asking_too_much_work_get_400_naming_the_limit_on_every_route(server):
    """Each way a small body asks for unbounded work, sent over HTTP to the routes that take it: a 400 naming
    the `stages.serve.limits` key to raise (the server's limits: max_tokens 32, the rest at their defaults),
    answered by the guard in milliseconds; then ordinary completions and chat requests still answer 200. (The
    other routes are checked for refusals only: this model's engine refuses even a good /tokenize request.)"""
    import httpx

    url, model = server
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    text = {"model": model, "prompt": "Calculate 1 + 1.", "max_tokens": 4}
    deep = b"[" * 200000  # answered 500 (RecursionError) before the guard counted nesting
    L = "stages.serve.limits."
    cases = [  # (route, body, what the answer names)
        ("/v1/completions", {**text, "prompt": ["1 + 1"] * 65}, f"{L}max_prompts (64)"),
        ("/v1/completions", {**text, "prompt": [[1, 2]] * 65}, f"{L}max_prompts (64)"),
        ("/v1/completions", {**text, "prompt": ["1 + 1"] * 64, "n": 8, "max_tokens": 32},
         f"{L}max_request_tokens (8192)"),
        ("/v1/completions", {**text, "prompt_logprobs": 6}, f"{L}max_logprobs (5)"),
        ("/v1/completions", {**text, "logprobs": -1}, f"{L}max_logprobs"),
        ("/v1/completions", {**text, "stop": ["a"] * 5}, f"{L}max_stop (4)"),
        ("/v1/completions", {**text, "logit_bias": {str(i): 1 for i in range(301)}}, f"{L}max_logit_bias (300)"),
        ("/v1/completions", {**text, "bad_words": ["a"] * 33}, f"{L}max_bad_words (32)"),
        ("/v1/completions", {**text, "allowed_token_ids": list(range(1025))}, f"{L}max_token_ids (1024)"),
        ("/v1/completions", {**text, "max_tokens": -1}, f"{L}max_tokens"),
        ("/v1/completions", deep, f"{L}max_json_depth (32)"),
        ("/v1/chat/completions", {**chat, "stop": "x" * 129}, f"{L}max_word_chars (128)"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": -1}, f"{L}max_logprobs"),
        ("/v1/chat/completions", {**chat, "prompt_logprobs": 6}, f"{L}max_logprobs (5)"),
        ("/v1/chat/completions", {**chat, "n": True}, "n must be an integer, not true"),
        ("/v1/chat/completions", deep, f"{L}max_json_depth (32)"),
        ("/v1/embeddings", {"model": model, "input": ["x"] * 65}, f"{L}max_prompts (64)"),
        ("/v1/score", {"model": model, "text_1": "q", "text_2": ["d"] * 65}, f"{L}max_prompts (64)"),
        ("/tokenize", deep, f"{L}max_json_depth (32)"),
    ]
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        for route, body, expected in cases:
            r = http.post(route, content=body if isinstance(body, bytes) else json.dumps(body),
                          headers={"content-type": "application/json"})
            error = r.json()["error"]
            assert (r.status_code, error["code"], error["type"]) == (400, 400, "invalid_request_error"), (route, r.text)
            assert expected in error["message"], (route, expected, error["message"])
        for route, body in (("/v1/completions", text), ("/v1/chat/completions", chat)):
            r = http.post(route, json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0, (route, r.text)


def test_binds_to_loopback_only(server):
    import psutil

    others = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
              if a.family == socket.AF_INET and not a.address.startswith("127.")]
    assert others, "this machine has no non-loopback IPv4 address to check against"
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", PORT)) == 0  # it is listening ...
    for ip in others:
        with socket.socket() as s:
            s.settimeout(5)
            assert s.connect_ex((ip, PORT)) != 0, ip  # ... but not on this machine's other addresses


@pytest.mark.tier("faults", covers=("stages/serve/", "pipeline/upstream/",))
def test_a_killed_engine_answers_503_then_its_replica_is_replaced(server):
    """vLLM's worker process dies (killed here; OOM or a crash elsewhere): requests meanwhile get 503 with
    Retry-After, never a 500, and Serve's health check replaces the replica, which then answers."""
    import time

    import httpx
    import psutil
    from ray.util.state import list_actors

    url, model = server
    replica = next(a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "LLMServer" in a.class_name)
    workers = [p for p in psutil.Process(replica.pid).children(recursive=True) if p.name() == "VLLM::Worker"]
    assert workers, [p.name() for p in psutil.Process(replica.pid).children(recursive=True)]
    for worker in workers:  # the engine's own process, under the replica our fixture deployed
        worker.kill()
    seen, deadline = [], time.time() + 300
    with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"}) as http:
        while time.time() < deadline:
            r = http.post("/v1/completions", json={"model": model, "prompt": "Calculate 1 + 1.", "max_tokens": 4})
            seen.append((r.status_code, r.headers.get("retry-after")))
            if r.status_code == 200:
                break
            time.sleep(0.5)
    statuses = [status for status, _ in seen]
    assert statuses[-1] == 200 and 503 in statuses, seen
    assert set(statuses) == {503, 200} and all(after for status, after in seen if status == 503), seen
    print(f"after the kill: {len(seen) - 1} answers 503, then 200")


def test_batch_infer_writes_one_row_per_prompt(registered, tracking_uri, tmp_path):
    import pyarrow.parquet as pq
    from mlflow.tracking import MlflowClient

    run_dir, _ = registered
    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(5)]
    rows += [{"prompt": "", "answer": "0"}, {"prompt": "1 + 1 " * 400, "answer": "2"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    result = run_cli("batch-infer", str(SMOKE), f"run_dir={run_dir}", f"mlflow.tracking_uri={tracking_uri}",
                     "--model", "models:/posttrain-policy@champion", "--prompts", str(prompts), "--output", str(out),
                     "stages.batch_infer.sampling.max_tokens=6", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    table = pq.read_table(out / "predictions").to_pylist()
    assert sorted(r["prompt"] for r in table) == sorted(r["prompt"] for r in rows)
    by_prompt = {r["prompt"]: r for r in table}
    assert by_prompt[""]["error"] and "context length" in by_prompt["1 + 1 " * 400]["error"]
    good = [by_prompt[r["prompt"]] for r in rows[:5]]
    assert all(not r["error"] and r["num_generated_tokens"] > 0 and r["correct"] in (0.0, 1.0) for r in good)
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["rows"], summary["rows_failed"], summary["accuracy_rows"]) == (7, 2, 5)
    assert "2 failed" in result.stdout
    # The generation's throughput apart from the start-up (Ray's start, the engine's build): higher than the
    # whole run's tokens over its wall time, which the summary used to report as tokens_per_s
    assert summary["generation_tokens_per_s"] > summary["generated_tokens"] / summary["wall_s"] > 0
    assert 0 < summary["startup_s"] < summary["wall_s"] and 0 < summary["generation_s"] < summary["wall_s"]
    assert "tokens_per_s" not in summary
    assert f"{summary['generation_tokens_per_s']:.1f} tokens/s; start-up {summary['startup_s']:.1f}s" in result.stdout
    # The console is run's: our lines, one per event; the libraries' output is in the command's log
    console = (result.stdout + result.stderr).splitlines()
    assert len(console) <= 12 and not [line for line in console if LIBRARY.search(line)], "\n".join(console)
    log = (run_dir / "logs" / "batch-infer.log").read_text()
    assert "INFO" in log and "(MapWorker(MapBatches(vLLMEngineStageUDF)) pid=" in log
    client = MlflowClient(tracking_uri)
    run = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id],
                             filter_string="attributes.run_name = 'batch-infer'")[0]
    assert run.data.metrics["rows"] == 7 and run.data.metrics["rows_failed"] == 2
    for name in ("generation_tokens_per_s", "startup_s", "generation_s"):
        assert run.data.metrics[name] == pytest.approx(summary[name]), name
    # A second call never overwrites the results.
    again = run_cli("batch-infer", str(SMOKE), f"run_dir={run_dir}", f"mlflow.tracking_uri={tracking_uri}",
                    "--prompts", str(prompts), "--output", str(out))
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


@pytest.mark.tier("faults", covers=("stages/serve/", "pipeline/__main__.py", "pipeline/upstream/"))
def test_sigterm_ends_pipeline_serve_cleanly_with_exit_130(registered, tracking_uri, tmp_path):
    """`kill PID` on `pipeline serve`: the app is deleted, Ray (which it started) shut down with all its
    processes, exit 130. (Ray's own SIGTERM handler aborted the process, leaving its dashboard and
    agents running.) Its console is run's: our lines, one per event; Ray's, Serve's and vLLM's output
    is in its log, which the last line names."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT
    from helpers.cluster import end_tree, process_tree

    run_dir, _ = registered
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", str(SMOKE), f"run_dir={run_dir}",
                             f"mlflow.tracking_uri={tracking_uri}", f"stages.serve.http.port={PORT + 1}"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, start_new_session=True)
    try:
        seen, deadline = "", time.time() + 600
        while "until Ctrl-C" not in seen and time.time() < deadline and proc.poll() is None:
            seen += proc.stdout.readline()
        assert "until Ctrl-C" in seen, seen[-3000:]
        started = process_tree(proc.pid)[1:]  # Ray's processes, engines, agents: all started by the command
        assert len(started) > 3
        os.kill(proc.pid, signal.SIGTERM)
        rest, _ = proc.communicate(timeout=180)
    finally:
        end_tree(proc.pid)
    assert proc.returncode == 130, (seen + rest)[-3000:]
    assert "shutting the API down" in rest
    console, log = (seen + rest).splitlines(), run_dir / "logs" / "serve-command.log"
    assert len(console) <= 15 and not [line for line in console if LIBRARY.search(line)], seen + rest
    assert f"serve was interrupted; its log: {log}" in rest
    assert "(ServeController pid=" in log.read_text() and "INFO" in log.read_text()
    time.sleep(2)

    def running(pid):  # exists and is not a zombie awaiting its parent
        try:
            return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    alive = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120] for p in started if running(p)}
    for pid in alive:  # what the command left behind (started by this test): ended by PID
        os.kill(pid, signal.SIGKILL)
    assert alive == {}
