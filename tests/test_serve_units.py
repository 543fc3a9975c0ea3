"""Serve and batch-inference parts without Ray: the model registry on a real MLflow store, the request
guard as an ASGI app, config validation, planning, and the pure helpers."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from conftest import smoke_config
from pipeline import storage
from pipeline.errors import ConfigError, UserError
from pipeline.runner import build_plan
from stages.batch_infer import BatchInferConfig, check_not_all_failed, request, result, summarize
from stages.common import model_registry
from stages.serve import key_tags
from stages.serve.app import percentile
from stages.serve.guard import RETRY_AFTER_S, LimitsConfig, RequestGuard, check_body


def _model(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 64}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_registry_versions_only_changed_models_and_moves_the_alias(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    run = lambda: client.create_run(exp).info.run_id  # noqa: E731
    a = _model(tmp_path / "a", b"weights-1")
    first = model_registry.register(client, "m", "champion", a, run(), {"cache_key": "k1", "metric.accuracy": "0.5"})
    assert (first["version"], first["new_version"], first["uri"]) == (1, True, "models:/m@champion")

    copy = shutil.copytree(a, tmp_path / "a-copy")  # same files elsewhere: the same model
    again = model_registry.register(client, "m", "champion", copy, run(), {"cache_key": "k2"})
    assert (again["version"], again["new_version"]) == (1, False)
    assert len(client.search_model_versions("name = 'm'")) == 1

    b = _model(tmp_path / "b", b"weights-2")
    second = model_registry.register(client, "m", "champion", b, run(), {"cache_key": "k3"})
    assert (second["version"], second["new_version"]) == (2, True)
    version = client.get_model_version_by_alias("m", "champion")
    assert int(version.version) == 2 and version.tags["cache_key"] == "k3" and \
        version.tags["model_hash"] == second["model_hash"]
    assert client.get_model_version("m", "1").tags["metric.accuracy"] == "0.5"

    # Back to the first model: no third version, the alias returns to version 1.
    back = model_registry.register(client, "m", "champion", a, run(), {})
    assert (back["version"], back["new_version"]) == (1, False)
    assert int(client.get_model_version_by_alias("m", "champion").version) == 1

    # Fetched by URI, as another machine would: the files are the registered ones.
    got = model_registry.fetch("models:/m@champion", uri, tmp_path / "cache")
    assert (got / "model.safetensors").read_bytes() == b"weights-1"
    assert model_registry.fetch("models:/m/2", uri, tmp_path / "cache").joinpath("model.safetensors").read_bytes() == \
        b"weights-2"
    assert not list((tmp_path / "cache" / "m").glob(".download-*"))  # no half-written download left behind
    # Another registry's "version 1" is another model: never served from the first one's download.
    other_uri = f"sqlite:///{tmp_path / 'other.db'}"
    other = MlflowClient(other_uri)
    other_exp = other.create_experiment("e", artifact_location=(tmp_path / "other-art").as_uri())
    c = _model(tmp_path / "c", b"weights-other")
    assert model_registry.register(
        other, "m", "champion", c, other.create_run(other_exp).info.run_id, {})["version"] == 1
    assert model_registry.fetch("models:/m/1", other_uri, tmp_path / "cache").joinpath(
        "model.safetensors").read_bytes() == b"weights-other"
    assert model_registry.fetch("models:/m/1", uri, tmp_path / "cache").joinpath(
        "model.safetensors").read_bytes() == b"weights-1"
    with pytest.raises(UserError, match="models:/m@nope: not found in the model registry"):
        model_registry.fetch("models:/m@nope", uri, tmp_path / "cache")
    with pytest.raises(UserError, match="not a model directory"):
        model_registry.fetch(str(tmp_path), uri, tmp_path / "cache")


def _call(app, method: str, body: bytes = b"", headers=(), answer=(200, [b"ok"]), path: str = "/v1/completions"):
    """Send one request to `path` through an ASGI app whose inner app answers `answer` (status, body chunks);
    returns (status, body bytes, body the inner app saw); the response headers are left in `_call.headers`."""
    seen, sent = {}, []

    async def inner(scope, receive, send):
        seen["body"] = (await receive())["body"]
        status, chunks = answer
        await send({"type": "http.response.start", "status": status, "headers": []})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}
    asyncio.run(app(inner)(scope, receive, send))
    _call.headers = dict(sent[0]["headers"])
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), seen.get("body")


def test_request_guard_checks_the_key_and_the_body():
    def guard(key):
        return lambda inner: RequestGuard(inner, key)

    status, body, _ = _call(guard("s3cret"), "POST", b"{}")
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, _ = _call(guard("s3cret"), "POST", b"{}", [(b"authorization", b"Bearer wrong")])
    assert status == 401
    status, body, seen = _call(guard("s3cret"), "POST", b'{"a": 1, "max_tokens": 5}',
                               [(b"authorization", b"Bearer s3cret")])
    assert (status, body, seen) == (200, b"ok", b'{"a": 1, "max_tokens": 5}')  # the body reaches the ingress unchanged
    # A request naming no max_tokens reaches the engine as it is: vLLM gives it the limit, capped by what
    # the context leaves (a limit above the context must not turn every such request into a 400).
    assert _call(guard(None), "POST", b'{"a": 1}')[2] == b'{"a": 1}'
    status, body, seen = _call(guard(None), "POST", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"] and seen is None
    assert _call(guard(None), "POST", b"[1, 2]")[0] == 400


def test_request_guard_enforces_the_sampling_limits():
    def limited(inner):
        return RequestGuard(inner, None, LimitsConfig(max_tokens=16, max_n=2, max_logprobs=3, max_body_bytes=2048))

    status, body, seen = _call(limited, "POST", b'{"max_tokens": 17}')
    assert status == 400 and "max_tokens: 17, above stages.serve.limits.max_tokens (16)" in \
        json.loads(body)["error"]["message"]
    assert seen is None  # never reached the engine
    assert _call(limited, "POST", b'{"max_completion_tokens": 99}')[0] == 400
    assert "n: 3, above stages.serve.limits.max_n (2)" in \
        json.loads(_call(limited, "POST", b'{"n": 3}')[1])["error"]["message"]
    assert _call(limited, "POST", b'{"max_tokens": 16, "n": 2}')[0] == 200  # at the limits
    big = LimitsConfig(max_tokens=200000, max_request_tokens=200000)
    assert _call(lambda inner: RequestGuard(inner, None, big), "POST", b'{"max_tokens": 100000}')[0] == 200
    # numbers that are not JSON integers are refused before any comparison could be fooled
    for bad in (b'{"n": "64"}', b'{"n": 1e4}', b'{"n": 2.0}', b'{"max_tokens": "9999"}', b'{"best_of": true}'):
        status, body, seen = _call(limited, "POST", bad)
        assert status == 400 and "must be an integer" in json.loads(body)["error"]["message"] and seen is None, bad
    assert "best_of: 3, above" in json.loads(_call(limited, "POST", b'{"best_of": 3}')[1])["error"]["message"]
    assert _call(limited, "POST", b'{"top_logprobs": 4}')[0] == 400 and \
        _call(limited, "POST", b'{"logprobs": 4}')[0] == 400
    assert _call(limited, "POST", b'{"logprobs": true, "top_logprobs": 3}')[0] == 200  # chat's boolean logprobs
    status, body, seen = _call(limited, "POST", b'{"prompt": "' + b"x" * 3000 + b'"}')
    assert status == 413 and seen is None


# Small limits, so each case is a small body; the work budget (64) is below max_n x max_tokens (128) on purpose.
SMALL = LimitsConfig(max_tokens=32, max_n=4, max_logprobs=3, max_prompts=8, max_request_tokens=64, max_stop=2,
                     max_bad_words=2, max_word_chars=10, max_logit_bias=3, max_token_ids=5, max_json_depth=8)
COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
MESSAGES = [{"role": "user", "content": "hi"}]
L = "stages.serve.limits."
TOO_MUCH = {  # id: (route, body, what the objection says)
    "prompt list": (COMPLETIONS, {"prompt": ["x"] * 9, "max_tokens": 1},
                    f"prompt: 9 prompts, above {L}max_prompts (8)"),
    "token-id prompts": (COMPLETIONS, {"prompt": [[1, 2]] * 9, "max_tokens": 1},
                         f"prompt: 9 prompts, above {L}max_prompts"),
    "prompt_embeds list": (COMPLETIONS, {"prompt_embeds": ["AA=="] * 9},
                           f"prompt_embeds: 9 prompts, above {L}max_prompts"),
    "prompts x n x max_tokens": (COMPLETIONS, {"prompt": ["x"] * 4, "n": 2, "max_tokens": 16},
                                 f"may generate 128 tokens (4 prompt(s) x n 2 x max_tokens 16), above "
                                 f"{L}max_request_tokens (64)"),
    "no max_tokens counts the limit": (COMPLETIONS, {"prompt": ["x"] * 3},
                                       f"(none given: {L}max_tokens) 32), above {L}max_request_tokens (64)"),
    "best_of counts": (COMPLETIONS, {"prompt": "x", "best_of": 3, "max_tokens": 32}, f"above {L}max_request_tokens"),
    "chat n x max_completion_tokens": (CHAT, {"messages": MESSAGES, "n": 3, "max_completion_tokens": 32},
                                       f"may generate 96 tokens (1 prompt(s) x n 3 x max_tokens 32), above "
                                       f"{L}max_request_tokens"),
    "chat n without max_tokens": (CHAT, {"messages": MESSAGES, "n": 3}, f"above {L}max_request_tokens (64)"),
    "stop count": (COMPLETIONS, {"stop": ["a", "b", "c"]}, f"stop: 3 entries, above {L}max_stop (2)"),
    "stop length": (CHAT, {"messages": MESSAGES, "stop": "x" * 11},
                    f"stop: a string of 11 characters, above {L}max_word_chars (10)"),
    "logit_bias": (COMPLETIONS, {"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}},
                   f"logit_bias: 4 entries, above {L}max_logit_bias (3)"),
    "bad_words count": (COMPLETIONS, {"bad_words": ["a", "b", "c"]},
                        f"bad_words: 3 entries, above {L}max_bad_words (2)"),
    "bad_words length": (CHAT, {"messages": MESSAGES, "bad_words": ["x" * 11]}, f"above {L}max_word_chars (10)"),
    "allowed_token_ids": (COMPLETIONS, {"allowed_token_ids": list(range(6))},
                          f"allowed_token_ids: 6 entries, above {L}max_token_ids (5)"),
    "stop_token_ids": (CHAT, {"messages": MESSAGES, "stop_token_ids": list(range(6))}, f"above {L}max_token_ids (5)"),
    "logprob_token_ids": (COMPLETIONS, {"logprobs": 3, "logprob_token_ids": [1, 2, 3, 4]},
                          f"above {L}max_logprobs (3)"),
    "prompt_logprobs": (COMPLETIONS, {"prompt_logprobs": 4}, f"prompt_logprobs: 4, above {L}max_logprobs (3)"),
    "chat prompt_logprobs": (CHAT, {"messages": MESSAGES, "prompt_logprobs": 4}, f"above {L}max_logprobs (3)"),
    "min_tokens": (COMPLETIONS, {"min_tokens": 33}, f"min_tokens: 33, above {L}max_tokens (32)"),
    "negative logprobs (the whole vocabulary to vLLM)": (
        COMPLETIONS, {"logprobs": -1}, f"logprobs: -1 is below 0; this server takes 0 to 3 ({L}max_logprobs)"),
    "negative prompt_logprobs": (COMPLETIONS, {"prompt_logprobs": -1}, "prompt_logprobs: -1 is below 0; this server "
                                 "takes 0 to 3"),
    "negative top_logprobs": (CHAT, {"messages": MESSAGES, "top_logprobs": -1}, "top_logprobs: -1 is below 0"),
    "negative max_tokens": (COMPLETIONS, {"max_tokens": -5},
                            f"max_tokens: -5 is below 0; this server takes 0 to 32 ({L}max_tokens)"),
    "negative max_completion_tokens": (CHAT, {"messages": MESSAGES, "max_completion_tokens": -1},
                                       "max_completion_tokens: -1 is below 0"),
    "n of 0": (COMPLETIONS, {"n": 0}, f"n: 0 is below 1; this server takes 1 to 4 ({L}max_n)"),
    "negative best_of": (COMPLETIONS, {"best_of": -2}, "best_of: -2 is below 1"),
    "negative min_tokens": (CHAT, {"messages": MESSAGES, "min_tokens": -1}, "min_tokens: -1 is below 0"),
    "bool n": (COMPLETIONS, {"n": True}, "n must be an integer, not true"),
    "bool prompt_logprobs": (COMPLETIONS, {"prompt_logprobs": True}, "prompt_logprobs must be an integer, not true"),
    "bool max_tokens": (CHAT, {"messages": MESSAGES, "max_tokens": False}, "max_tokens must be an integer, not false"),
    "stop as an object": (COMPLETIONS, {"stop": {"a": 1}}, "stop must be a list"),
    "stop of numbers": (COMPLETIONS, {"stop": [1]}, "stop must hold strings"),
    "logit_bias as a list": (COMPLETIONS, {"logit_bias": [1, 2]}, "logit_bias must be an object"),
    "prompt as a number": (COMPLETIONS, {"prompt": 5}, "prompt must be a string or a list"),
    "embeddings input list": (EMBEDDINGS, {"input": ["x"] * 9}, f"input: 9 prompts, above {L}max_prompts (8)"),
    "embeddings token-id inputs": (EMBEDDINGS, {"input": [[1], [2]] * 5}, f"input: 10 prompts, above {L}max_prompts"),
    "score documents": ("/v1/score", {"text_1": "q", "text_2": ["d"] * 9}, f"text_2: 9 prompts, above {L}max_prompts"),
    "tokenize prompt list": ("/tokenize", {"prompt": ["x"] * 9}, f"prompt: 9 prompts, above {L}max_prompts"),
    "a route Ray may add later": ("/v1/responses", {"input": ["x"] * 9}, f"input: 9 prompts, above {L}max_prompts"),
    "sampling fields on any route": ("/detokenize", {"tokens": [1], "n": -1}, "n: -1 is below 1"),
}
WITHIN = {  # id: (route, body): at the limits, or work that does not count
    "prompts x n x max_tokens at the budget": (COMPLETIONS, {"prompt": ["x"] * 8, "max_tokens": 8}),
    "one token-id prompt": (COMPLETIONS, {"prompt": list(range(500)), "n": 4, "max_tokens": 16}),
    "chat at the budget": (CHAT, {"messages": MESSAGES, "n": 2}),
    "scoring a prompt without generating": (COMPLETIONS, {"prompt": ["x"] * 8, "max_tokens": 0, "echo": True,
                                                          "prompt_logprobs": 3}),
    "embeddings generate nothing": (EMBEDDINGS, {"input": ["x"] * 8}),
    "chat logprobs, stop, bias at their limits": (CHAT, {
        "messages": MESSAGES, "logprobs": True, "top_logprobs": 3, "stop": ["a", "x" * 10],
        "logit_bias": {"1": 1, "2": 1, "3": 1}, "allowed_token_ids": [1, 2, 3, 4, 5], "max_tokens": 32}),
    "one stop string": (COMPLETIONS, {"stop": "x" * 10, "max_tokens": 4}),
}


@pytest.mark.parametrize("case", TOO_MUCH, ids=list(TOO_MUCH))
def test_a_request_asking_too_much_work_is_refused_naming_the_limit(case):
    route, body, expected = TOO_MUCH[case]
    problem = check_body(json.dumps(body).encode(), SMALL, route)
    assert problem is not None and expected in problem, problem
    status, answer, seen = _call(lambda inner: RequestGuard(inner, None, SMALL), "POST", json.dumps(body).encode(),
                                 path=route)
    assert (status, seen) == (400, None)  # never reached the ingress
    assert json.loads(answer) == {"error": {"message": problem, "type": "invalid_request_error", "param": None,
                                            "code": 400}}


@pytest.mark.parametrize("case", WITHIN, ids=list(WITHIN))
def test_a_request_within_the_limits_passes_unchanged(case):
    route, body = WITHIN[case]
    raw = json.dumps(body).encode()
    assert check_body(raw, SMALL, route) is None
    assert _call(lambda inner: RequestGuard(inner, None, SMALL), "POST", raw, path=route)[::2] == (200, raw)


def test_deep_or_malformed_json_is_a_400_never_a_500():
    """`"[" * 200000` answered 500 (RecursionError in the parser) on a live server: the nesting is counted
    before parsing, and a parser's RecursionError is still an objection, never an exception."""
    deep = f"request body nests arrays/objects more than {L}max_json_depth"
    for body in (b"[" * 200000, b'{"a":' * 100000, b"[" * 500 + b"]" * 500,
                 b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}"):
        assert deep in check_body(body), body[:20]
        status, answer, seen = _call(lambda inner: RequestGuard(inner, None), "POST", body)
        assert status == 400 and deep in json.loads(answer)["error"]["message"] and seen is None
    nested = lambda d: b'{"a": ' * d + b"1" + b"}" * d  # noqa: E731
    assert check_body(nested(8), SMALL) is None and "max_json_depth (8)" in check_body(nested(9), SMALL)
    # brackets inside strings (escaped quotes too) are text, not nesting
    assert check_body(json.dumps({"prompt": '"[[[[[[[[[[[{{{{{{{{{{\\"', "max_tokens": 1}).encode(), SMALL) is None
    for bad in (b"[}", b'{"a": [1, 2}', b'{"a": "unclosed', b"\xff\xfe", b'{"n": ' + b"9" * 5000 + b"}"):
        assert check_body(bad, SMALL).startswith("request body is not valid JSON"), bad[:20]


def test_a_body_is_read_as_utf8_once_so_utf16_cannot_hide_its_nesting():
    """`json.loads(bytes)` takes UTF-16, where U+0122 is the bytes 22 01: a byte-level scan saw a '"' there and
    took the 600 brackets after it for the inside of a string, so the body went through as 0 deep. Now a body
    is decoded once as strict UTF-8, every check reads that text, and anything else is a 400 saying so."""
    deep = '{"a": "\u0122", "prompt": ' + "[" * 600 + "]" * 600 + "}"
    assert json.loads(deep.encode("utf-16"))  # what the ingress's parser would have taken
    for body in (deep.encode("utf-16"), deep.encode("utf-16-le"), ("[" * 600 + "]" * 600).encode("utf-16"),
                 b'{"max_tokens": 4}'.decode().encode("utf-32")):
        problem = check_body(body, SMALL)
        assert problem is not None and "UTF-8" in problem, body[:20]
        status, answer, seen = _call(lambda inner: RequestGuard(inner, None, SMALL), "POST", body)
        assert status == 400 and "UTF-8" in json.loads(answer)["error"]["message"] and seen is None
    # The same text as UTF-8: counted on the decoded string, refused for its depth.
    assert f"{L}max_json_depth (8)" in check_body(deep.encode(), SMALL)
    assert check_body('{"prompt": "\u0122 [[[", "max_tokens": 1}'.encode(), SMALL) is None  # text, not nesting


def _cors_answers(origins: list[str], api_key: str | None = None) -> dict:
    """{origin: (status, Access-Control-Allow-Origin, -Credentials)} of a POST and a preflight from each of two
    origins to the ingress's FastAPI app as `build_app` makes it (a stub route in place of the engines)."""
    from starlette.testclient import TestClient

    from stages.serve.app import ingress_app

    app = ingress_app(api_key, SMALL, ["m"], origins)
    app.post("/v1/completions")(lambda: {"ok": True})
    client, auth = TestClient(app), {"authorization": f"Bearer {api_key}"} if api_key else {}
    answers = {}
    for origin in ("https://app.example.com", "https://evil.example"):
        post = client.post("/v1/completions", content=b'{"max_tokens": 1}', headers={"origin": origin, **auth})
        pre = client.options("/v1/completions", headers={"origin": origin, "access-control-request-method": "POST",
                                                         "access-control-request-headers": "authorization"})
        answers[origin] = [(r.status_code if r is post else "pre", r.headers.get("access-control-allow-origin"),
                            r.headers.get("access-control-allow-credentials")) for r in (post, pre)]
    return answers


def test_cors_is_closed_unless_origins_are_configured():
    """Ray Serve LLM's ingress let every origin in with credentials (`Origin: X` got `Access-Control-Allow-Origin:
    X`): any web page could use a key-less server on the user's machine. By default no answer now carries the
    header; `http.cors_origins` opens it to the origins it names (credentials too), '*' to any page without."""
    closed = _cors_answers([])
    assert all(allow is None for answers in closed.values() for _, allow, _ in answers), closed
    assert closed["https://evil.example"][0][0] == 200  # same-origin and non-browser clients are unaffected
    named = _cors_answers(["https://app.example.com"], api_key="k")
    assert named["https://app.example.com"] == [(200, "https://app.example.com", "true"),
                                                ("pre", "https://app.example.com", "true")]  # preflight: no key needed
    assert all(allow is None for _, allow, _ in named["https://evil.example"]), named
    anyone = _cors_answers(["*"])
    assert {allow for answers in anyone.values() for _, allow, _ in answers} == {"*"}
    assert all(creds is None for answers in anyone.values() for _, _, creds in answers), anyone


def test_cors_origins_must_be_origins(tmp_path):
    from stages.serve import HttpConfig

    assert HttpConfig().cors_origins == []
    assert HttpConfig(cors_origins=["https://a.example:8443", "http://localhost:3000"]).cors_origins[1] == \
        "http://localhost:3000"
    for bad, message in ((["https://a.example/"], "not an origin"), (["a.example"], "not an origin"),
                         (["*", "https://a.example"], "give it alone")):
        with pytest.raises(ValueError, match=message):
            HttpConfig(cors_origins=bad)


def test_every_post_route_of_the_ingress_goes_through_the_checks():
    """The routes `build_app` serves are Ray Serve LLM's DEFAULT_ENDPOINTS: each POST one is in the guard's
    table (a Ray upgrade adding one fails here), and each refuses a deep body and a negative field."""
    from fastapi import FastAPI
    from ray.llm._internal.serve.core.ingress.ingress import DEFAULT_ENDPOINTS

    from stages.serve.guard import ROUTES

    app = FastAPI()
    for route in DEFAULT_ENDPOINTS.values():
        route(app)(lambda: None)
    posts = {r.path for r in app.routes if "POST" in getattr(r, "methods", ())}
    assert posts == set(ROUTES)
    for path in sorted(posts):
        for body, expected in ((b"[" * 200000, f"{L}max_json_depth"),
                               (b'{"prompt_logprobs": -1}', f"{L}max_logprobs")):
            status, answer, seen = _call(lambda inner: RequestGuard(inner, None), "POST", body, path=path)
            assert status == 400 and expected in json.loads(answer)["error"]["message"] and seen is None, path


def test_the_work_budget_holds_one_default_completion(tmp_path):
    with pytest.raises(ConfigError, match=r"stages.serve.limits: max_request_tokens \(100\) is below max_tokens"):
        smoke_config(tmp_path, "stages.serve.limits.max_request_tokens=100")
    defaults = LimitsConfig()  # every single request within the per-field limits fits the budget
    assert defaults.max_request_tokens >= defaults.max_tokens * defaults.max_n


def test_a_dead_engine_is_answered_503_with_retry_after_and_other_errors_pass_through():
    def guard(inner):
        return RequestGuard(inner, None)

    dead = b'{"error": {"message": "original exception: ray::ServeReplica... RayTaskError(EngineDeadError): Engine'
    status, body, _ = _call(guard, "POST", b"{}", answer=(500, [dead, b'Core encountered an issue"}}']))
    assert status == 503 and _call.headers[b"retry-after"] == str(RETRY_AFTER_S).encode()
    assert json.loads(body)["error"]["type"] == "service_unavailable" and b"ServeReplica" not in body
    other = b'{"error": {"message": "Internal Server Error: ZeroDivisionError"}}'
    assert _call(guard, "POST", b"{}", answer=(500, [other]))[:2] == (500, other)  # not ours to relabel
    assert _call(guard, "POST", b"{}", answer=(200, [b"part1 ", b"EngineDeadError in a completion"]))[:2] == \
        (200, b"part1 EngineDeadError in a completion")  # a 200 is never touched, whatever its text


def test_requests_without_max_tokens_get_the_limit_from_the_engine(tmp_path):
    from stages.serve import ServeConfig
    from stages.serve.app import HEALTH_CHECK_PERIOD_S, llm_config

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    cfg = ServeConfig.model_validate({"limits": {"max_tokens": 1000}, "engine": {
        "extra": {"override_generation_config": {"max_new_tokens": 10**6, "temperature": 0.5}}}})
    llm = llm_config(cfg, tmp_path, gpu=False)
    # vLLM's generation default (capped by the context a prompt leaves), which `extra` cannot lift
    assert llm.engine_kwargs["override_generation_config"] == {"max_new_tokens": 1000, "temperature": 0.5}
    assert llm.deployment_config["health_check_period_s"] == HEALTH_CHECK_PERIOD_S


def test_the_serve_config_validates_for_a_gpu_against_rays_own_llm_config(tmp_path):
    """Issue 68: Ray's LLMConfig knows the kinds cpu, gpu and tpu; "cuda" was refused, so serving refused its own
    config on every GPU machine. Built as the stage builds it, the replica asks Ray for a GPU (or a CPU) bundle."""
    from stages.serve import ServeConfig
    from stages.serve.app import llm_config

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    for gpu, kind, bundle in ((True, "gpu", {"GPU": 1}), (False, "cpu", {"CPU": 1})):
        llm = llm_config(ServeConfig(), tmp_path, gpu=gpu)
        assert llm.accelerator_config.kind == kind
        assert llm.get_engine_config().placement_bundles == [bundle]
        assert llm.engine_kwargs["enforce_eager"] is not gpu  # CUDA graphs on a GPU


def test_pure_helpers():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert abs(percentile(list(map(float, range(1, 101))), 95) - 95.05) < 1e-9
    assert check_body(b'{"model": "x", "max_tokens": 4}') is None
    assert "not valid JSON" in check_body(b"")
    assert key_tags({"eval_accuracy": 0.25, "kl": 1.0, "eval_reward": "x"},
                    ["eval_accuracy", "eval_reward", "acc"]) == \
        {"metric.eval_accuracy": "0.25"}


def test_batch_rows_keep_every_input_and_report_failures():
    cfg = BatchInferConfig()
    ok = request({"prompt": "What is 1 + 2?", "answer": "3", "id": 7}, cfg)
    assert ok["messages"] == [{"role": "user", "content": "What is 1 + 2?"}] and \
        ok["sampling_params"]["max_tokens"] == 32
    bad = request({"prompt": "  ", "answer": "3", "id": 8}, cfg)
    # The processor answers ok with text; an error row comes back without postprocessing.
    row_ok = result({**ok, "generated_text": "1 + 2 = 3", "num_input_tokens": 9, "num_generated_tokens": 5})
    row_bad = result({**bad, "generated_text": "x", "num_generated_tokens": 1})
    row_long = result({**ok, "__inference_error__": "VLLMValidationError: too long"})
    assert row_ok == {"prompt": "What is 1 + 2?", "answer": "3", "id": 7, "completion": "1 + 2 = 3",
                      "num_input_tokens": 9, "num_generated_tokens": 5, "error": "", "latency_s": None,
                      "answered_at": None}
    assert row_bad["error"] == "'prompt' is empty or not text" and row_bad["completion"] == "" and row_bad["id"] == 8
    assert row_long["error"].startswith("VLLMValidationError") and row_long["num_generated_tokens"] == 0
    rows = [{**row_ok, "correct": 1.0, "reward": 0.5, "latency_s": 1.0, "answered_at": 101.5},
            {**row_bad, "correct": None, "reward": None}, row_long]
    assert summarize(rows, 100.0, 102.0) == {
        "rows": 3, "rows_failed": 2, "generated_tokens": 5, "wall_s": 2.0, "startup_s": 0.5, "generation_s": 1.0,
        "generation_tokens_per_s": 5.0, "accuracy": 1.0, "accuracy_rows": 1, "mean_reward": 0.5}
    check_not_all_failed(summarize(rows, 100.0, 102.0), "p.jsonl")  # some rows answered: a result
    with pytest.raises(RuntimeError, match="all 2 rows of p.jsonl failed"):  # none did: a failed stage, not cached
        check_not_all_failed(summarize([{**row_bad, "correct": None}, row_long], 100.0, 102.0), "p.jsonl")


def test_batch_throughput_is_the_generations_alone_and_start_up_is_reported_apart():
    """Tokens over [the first request's start, the last answer's end]: Ray's start and the engine's build,
    before the first request, are start-up. Each answered row carries, from the processor, the engine's
    time for it and when its answer left the engine; a row the engine did not answer carries neither."""
    import time

    from stages.batch_infer import _outputs, generation_span, summary_line

    ok = request({"prompt": "What is 1 + 2?", "answer": "3"}, BatchInferConfig())
    before = time.time()
    answered = result(_outputs({**ok, "generated_text": "3", "num_input_tokens": 9, "num_generated_tokens": 1,
                                "time_taken_llm": 2.5}))
    assert answered["latency_s"] == 2.5 and before <= answered["answered_at"] <= time.time()
    assert [result({**ok, "__inference_error__": "x", "time_taken_llm": -1})[k] for k in ("latency_s", "answered_at")] \
        == [None, None]  # an error row skips the postprocess
    assert result({**ok, "latency_s": float("nan"), "answered_at": float("nan")})["latency_s"] is None  # a mixed block

    def row(tokens, answered_at, latency):
        return {"error": "", "num_generated_tokens": tokens, "answered_at": answered_at, "latency_s": latency}

    # Started at 100; the engine took its first request at 130 (the first batch's slowest row: 10 s, answered
    # at 140) and answered the last at 150; the results were written at 155.
    rows = [row(6, 140.0, 10.0), row(4, 140.0, 4.0), row(10, 150.0, 10.0),
            {"error": "context length", "num_generated_tokens": 0, "answered_at": None, "latency_s": None}]
    assert generation_span(rows) == (130.0, 150.0)
    summary = summarize(rows, 100.0, 155.0)
    assert (summary["startup_s"], summary["generation_s"], summary["wall_s"]) == (30.0, 20.0, 55.0)
    assert summary["generation_tokens_per_s"] == 1.0  # 20 tokens in 20 s; over the whole 55 s it would be 0.36
    assert "tokens_per_s" not in summary
    line = summary_line(summary)
    assert "20 tokens generated in 20.00s, 1.0 tokens/s; start-up 30.0s before the first request" in line
    nothing = summarize(rows[3:], 100.0, 155.0)  # no row answered: all of it was start-up
    assert generation_span(rows[3:]) is None and \
        (nothing["startup_s"], nothing["generation_tokens_per_s"]) == (55.0, 0.0)


def test_serve_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="stages.serve.registry.alias: .*reserved by MLflow"):
        smoke_config(tmp_path, "stages.serve.registry.alias=v2")
    with pytest.raises(ConfigError, match=r"stages.serve.replicas: 4 replica\(s\) need 9 logical CPUs"):
        smoke_config(tmp_path, "ray.num_cpus=8", "stages.serve.replicas=4")
    smoke_config(tmp_path, "ray.num_cpus=8", "stages.serve.replicas=4", "stages.serve.deploy=false")  # registers only
    with pytest.raises(ConfigError, match="stages.serve.source: "):
        smoke_config(tmp_path, "stages.serve.source=reward_model")
    with pytest.raises(ConfigError, match="stages.batch_infer.prompts: prompts file not found"):
        smoke_config(tmp_path, f"stages.batch_infer.prompts={tmp_path / 'none.jsonl'}")
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(ConfigError, match="p.txt: unsupported format"):
        smoke_config(tmp_path, f"stages.batch_infer.prompts={tmp_path / 'p.txt'}")
    with pytest.raises(ConfigError, match="stages.serve.engine.dtype"):
        smoke_config(tmp_path, "stages.serve.engine.dtype=fp8")
    with pytest.raises(ConfigError, match=r"stages.serve: .*smoke.max_tokens \(16\) exceeds limits.max_tokens \(8\)"):
        smoke_config(tmp_path, "stages.serve.limits.max_tokens=8")


def test_serve_reads_its_source_and_runs_every_time_only_when_blocking(tmp_path):
    plan = {p.spec.name: p for p in build_plan(smoke_config(tmp_path, "stages.serve.source=sft_model"))}
    assert plan["serve"].spec.inputs == ("sft_model",)
    cfg = smoke_config(tmp_path, "stages.serve.block=true")
    store = storage.ArtifactStore(cfg.run_dir)
    for p in build_plan(cfg):  # pretend every stage has finished once with this config
        store.begin(p.spec.name, p.key)
        store.commit(p.spec.name, p.key, {"outputs": {}})
    plan = {p.spec.name: p for p in build_plan(cfg)}
    assert all(plan[s].status == "hit" for s in ("model", "data", "sft", "reward", "ppo"))
    assert plan["serve"].status == "miss" and "until Ctrl-C" in plan["serve"].reason
    # block without deploy serves nothing: once finished, it is a cache hit like any stage
    quiet = smoke_config(tmp_path, "stages.serve.block=true", "stages.serve.deploy=false")
    for p in build_plan(quiet):
        store.begin(p.spec.name, p.key)
        store.commit(p.spec.name, p.key, {"outputs": {}})
    assert build_plan(quiet)[-1].spec.name == "serve" and build_plan(quiet)[-1].status == "hit"


def test_serve_command_without_a_config_names_the_missing_model(tmp_path, capfd, monkeypatch):
    from conftest import cli_in_process

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'm.db'}")
    # No store there: no run to read, and none is made (MLflow would create an empty one and search it)
    result = cli_in_process(capfd, "serve", f"run_dir={tmp_path}", "--model", "models:/no-such-model@champion")
    assert result.returncode == 2 and "no run has tracked to " + str(tmp_path / "m.db") in result.stderr
    assert not (tmp_path / "m.db").exists()
    from mlflow.tracking import MlflowClient

    MlflowClient(f"sqlite:///{tmp_path / 'm.db'}").search_experiments()  # a store, without the model
    result = cli_in_process(capfd, "serve", f"run_dir={tmp_path}", "--model", "models:/no-such-model@champion")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "models:/no-such-model@champion: not found in the model registry" in result.stderr
    assert str(tmp_path / "m.db") in result.stderr  # it looked in the environment's tracking store


def test_websockets_need_the_key_too_and_a_public_bind_needs_a_key(tmp_path):
    sent = []

    async def inner(scope, receive, send):
        sent.append("reached the app")

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/realtime", "headers": []}
    asyncio.run(RequestGuard(inner, "k")(scope, receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]  # handshake refused, the app never saw it
    with pytest.raises(ConfigError, match="host 0.0.0.0 exposes the API beyond this machine without an API key"):
        smoke_config(tmp_path, "stages.serve.http.host=0.0.0.0")
    # accepted with a key, or when told so, and bound where asked (a config object is always truthy: its fields say it)
    keyed = smoke_config(tmp_path, "stages.serve.http.host=0.0.0.0",
                         "stages.serve.http.api_key_env=KEY").stages.serve.http
    assert (keyed.host, keyed.api_key_env, keyed.allow_unauthenticated) == ("0.0.0.0", "KEY", False)
    opened = smoke_config(tmp_path, "stages.serve.http.host=0.0.0.0",
                          "stages.serve.http.allow_unauthenticated=true").stages.serve.http
    assert (opened.host, opened.api_key_env, opened.allow_unauthenticated) == ("0.0.0.0", None, True)


def test_engines_load_safetensors_only_and_every_served_model_passes_the_safety_check(tmp_path):
    import json as _json

    from stages.common.serving import EngineConfig, engine_kwargs

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(_json.dumps({"max_position_embeddings": 64}))
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    kwargs = engine_kwargs(EngineConfig(extra={"enable_prefix_caching": True}), model, gpu=False)
    assert kwargs["load_format"] == "safetensors" and kwargs["trust_remote_code"] is False
    # `extra` cannot reopen what the project pins (issue 67): refused at validation, naming the key, however spelled,
    # for serve and batch inference alike, from YAML or an override
    for key in ("load_format", "trust_remote_code", "Trust-Remote-Code"):
        with pytest.raises(ValidationError, match=f"extra.{key}\n  not allowed in extra"):
            EngineConfig(extra={key: "pt" if "format" in key else True})
    for stage in ("serve", "batch_infer"):
        with pytest.raises(UserError, match=f"stages.{stage}.engine.extra.trust_remote_code: not allowed in extra"):
            smoke_config(tmp_path, f"stages.{stage}.engine.extra.trust_remote_code=true")
    with pytest.raises(UserError, match="stages.sft.deepspeed.extra.load_format: not allowed in extra"):
        smoke_config(tmp_path, "stages.sft.deepspeed.extra.load_format=pt")  # nor in DeepSpeed's raw mapping
    with pytest.raises(UserError, match="only pickle weights"):  # `pipeline serve --model DIR`, batch-infer
        model_registry.fetch(str(model), "sqlite:///unused.db", tmp_path / "cache")


def test_deploying_reports_running_replicas_until_serve_run_returns(monkeypatch):
    """`serve.run` says nothing for the minute vLLM takes to start: a watcher reports the app's
    running replicas (LLM servers + ingress) as progress."""
    import threading
    from types import SimpleNamespace

    from ray import serve

    from stages.serve.app import APP, _watch_replicas

    polls = iter([{"LLMServer": {"STARTING": 1}, "OpenAiIngress": {"RUNNING": 1}},
                  {"LLMServer": {"RUNNING": 1}, "OpenAiIngress": {"RUNNING": 1}}])
    stop, seen = threading.Event(), []

    def status():
        states = next(polls, None)
        if states is None:
            stop.set()
            states = {}
        deployments = {n: SimpleNamespace(replica_states=s) for n, s in states.items()}
        return SimpleNamespace(applications={APP: SimpleNamespace(status="DEPLOYING", deployments=deployments)})

    monkeypatch.setattr(serve, "status", status)
    _watch_replicas(lambda done, total, unit, note: seen.append((done, total, unit)), stop, 2, every_s=0.01)
    assert seen[:3] == [(0, 2, "replica"), (1, 2, "replica"), (2, 2, "replica")]


def _adapter(tmp_path, name: str, kind: str = "causal", r: int = 4):
    """A PEFT adapter directory saved as training saves one (`lora.save_adapter`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from stages.common import lora

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, pad_token_id=0, num_labels=1)
    model = LlamaForCausalLM(cfg) if kind == "causal" else LlamaForSequenceClassification(cfg)
    lora.save_adapter(lora.wrap(model, lora.LoraSection(r=r, alpha=2 * r), kind), tmp_path / name)
    return tmp_path / name


def test_adapters_to_serve_are_checked_and_named_before_anything_starts(tmp_path):
    from stages.serve.app import adapter_rank, lora_rank_limit, parse_adapter

    assert parse_adapter("ppo=runs/x/adapter") == ("ppo", Path("runs/x/adapter"))
    assert parse_adapter("runs/x/tuned")[0] == "tuned"  # named after its directory
    for bad, expected in (("a:b=dir", "letters, digits"), ("=dir", "NAME=DIR"), ("x=", "NAME=DIR")):
        with pytest.raises(UserError, match=expected):
            parse_adapter(bad)

    assert adapter_rank(_adapter(tmp_path, "causal", r=4)) == 4
    with pytest.raises(UserError, match="SEQ_CLS"):  # a reward model's adapter generates nothing
        adapter_rank(_adapter(tmp_path, "reward", kind="sequence"))
    with pytest.raises(UserError, match="not a directory"):
        adapter_rank(tmp_path / "missing")
    pickled = shutil.copytree(tmp_path / "causal", tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(UserError, match="adapter_model.bin, a pickle file"):
        adapter_rank(pickled)
    assert [lora_rank_limit(r) for r in (1, 4, 8, 16, 17, 320)] == [1, 8, 8, 16, 32, 320]
    with pytest.raises(UserError, match="512"):
        lora_rank_limit(600)


def test_served_adapters_switch_on_vllm_lora_and_unknown_model_names_get_404(tmp_path):
    from stages.serve import ServeConfig
    from stages.serve.app import llm_config

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    adapters = {"a": _adapter(tmp_path, "a", r=4), "b": _adapter(tmp_path, "b", r=12)}
    llm = llm_config(ServeConfig(), tmp_path, gpu=False, adapters=adapters)
    assert (llm.engine_kwargs["enable_lora"], llm.engine_kwargs["max_lora_rank"], llm.engine_kwargs["max_loras"]) == \
        (True, 16, 2)
    assert llm.lora_config.max_num_adapters_per_replica == 2 and llm.lora_config.dynamic_lora_loading_path is None
    assert llm_config(ServeConfig(), tmp_path, gpu=False).lora_config is None  # no adapters: LoRA stays off

    def guard(inner):
        return RequestGuard(inner, None, models=["m", "m:a"])

    status, body, seen = _call(guard, "POST", b'{"model": "m:other"}')
    assert status == 404 and seen is None and "'m:other' is not served here; this server has: m, m:a" in \
        json.loads(body)["error"]["message"]
    assert _call(guard, "POST", b'{"model": "m:a"}')[0] == 200 and _call(guard, "POST", b'{"prompt": "x"}')[0] == 200


def test_the_adapter_loader_hands_serve_the_named_directory(tmp_path):
    from stages.serve.app import LocalAdapters

    loader = LocalAdapters({"tuned": str(tmp_path)}, download_timeout_s=30, max_tries=3)  # as Serve LLM builds it
    first = asyncio.run(loader.load_model_from_config("m:tuned", None))
    assert (first.model_id, first.local_path) == ("m:tuned", str(tmp_path))
    assert asyncio.run(loader.load_model_from_config("m:tuned", None)) is first  # one vLLM id per adapter
    with pytest.raises(ValueError, match="no adapter named 'other'"):
        asyncio.run(loader.load_model_from_config("m:other", None))


def test_serve_refuses_a_reward_model_adapter_before_starting_ray(tmp_path, capfd):
    from conftest import cli_in_process

    reward = _adapter(tmp_path, "reward", kind="sequence")
    result = cli_in_process(capfd, "serve", f"run_dir={tmp_path}", "--model", str(tmp_path), "--adapter",
                            f"rm={reward}")
    assert result.returncode == 2 and "SEQ_CLS" in result.stderr and "Ray" not in result.stderr, result.stderr[-2000:]
