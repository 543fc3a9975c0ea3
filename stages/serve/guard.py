"""What one request to the served API may ask for, checked before it reaches an engine.

`LimitsConfig` (the serve stage's `limits`) caps the work of one request; the pure checks
(`check_body`: nesting, sampling fields, prompts x n x max_tokens; `unknown_model`; `engine_dead`)
say why a body is refused, naming the key to raise. A body is decoded once, as strict UTF-8
(`read_body`), and every check reads that one string or what it parses to: no check can see other
text than the next one (the byte-level nesting count and `json.loads(bytes)`, which also takes
UTF-16 and UTF-32, once disagreed, and a UTF-16 body 600 arrays deep went through).
`RequestGuard`, the ASGI middleware `app.build_app` puts in front of the OpenAI ingress, applies them with the API key
and answers in OpenAI's error shape; `cors_options` is the CORS it allows (none unless
`http.cors_origins` names origins). Nothing here imports Ray: all of it is tested as plain code.
"""

from __future__ import annotations

import hmac
import json
import re

from pydantic import Field, model_validator

from pipeline.schema import Section


# --------------------------------------------------------------------------- the limits and the checks


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
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def decode_body(body: bytes) -> tuple[str | None, str | None]:
    """(the body as text, None), or (None, why it is refused) when it is not strict UTF-8.

    JSON between systems is UTF-8 (RFC 8259). `json.loads` on bytes would also take UTF-16 and UTF-32, where a
    character such as U+0122 has a '"' byte: read as bytes, the brackets after it looked like the inside of a
    string and were not counted. Decoding once, here, gives every check (and the parser) the same text.
    A NUL character is never valid JSON but is what UTF-16 and UTF-32 text of ASCII looks like as UTF-8: said so."""
    try:
        text = body.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        return None, (f"request body is not valid JSON: it must be UTF-8 text ({exc.reason} at byte {exc.start}); "
                      "send it encoded as UTF-8")
    if "\x00" in text:
        return None, ("request body is not valid JSON: it holds NUL bytes, as UTF-16 or UTF-32 text does; send it "
                      "encoded as UTF-8")
    return text, None


def json_depth(text: str, limit: int) -> int:
    """How deep a JSON text nests arrays and objects, counted up to `limit` + 1, without parsing it.

    Python's parser recurses once per level: `"[" * 200000` raised RecursionError (a 500) before this, and a
    body passed on is parsed again by the ingress and validated by pydantic, both recursively. Strings are
    dropped (a bracket inside one does not count), then each pass removes the innermost pairs: all in C, so even
    1 MiB of brackets costs less than parsing it. Unbalanced brackets stop the count: the parser refuses them."""
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text))
    depth = 0
    while brackets and depth <= limit:
        brackets, removed = _INNERMOST.subn("", brackets)
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


def read_body(body: bytes, limits: LimitsConfig) -> tuple[dict | None, str | None]:
    """(the body's JSON object, None), or (None, why it is refused).

    The body is decoded once as strict UTF-8 (`decode_body`); its nesting is counted on that text and the
    same text is parsed, so what is counted is what is parsed. (Its size, max_body_bytes, is checked on the
    bytes as they arrive, `RequestGuard`: the same number, a UTF-8 text's length in bytes.)"""
    text, problem = decode_body(body or b"")
    if problem:
        return None, problem
    too_deep = f"request body nests arrays/objects more than {LIMIT}max_json_depth ({limits.max_json_depth}) deep"
    if json_depth(text, limits.max_json_depth) > limits.max_json_depth:
        return None, too_deep
    try:
        data = json.loads(text)
    except RecursionError:  # unbalanced brackets the count stopped at ("[" * 200000): no body makes a 500
        return None, too_deep
    except ValueError as exc:
        return None, f"request body is not valid JSON ({exc})"
    if not isinstance(data, dict):
        return None, "request body must be a JSON object"
    return data, None


def check_body(body: bytes, limits: LimitsConfig | None = None, route: str = "/v1/completions") -> str | None:
    """Why a POST body to `route` is refused, or None.

    The body must be a UTF-8 JSON object, nested at most max_json_depth deep (`read_body`), whose sampling
    fields are within `limits` (`field_objection`) and whose work is (`request_work`). Every objection names
    the limit to raise. A request naming no max_tokens is left as it is: the engine gives it
    `limits.max_tokens`, capped by what the context leaves (`llm_config`)."""
    limits = limits or LimitsConfig()
    data, problem = read_body(body, limits)
    return problem or request_objection(data, limits, route)


def request_objection(data: dict, limits: LimitsConfig, route: str) -> str | None:
    """Why a parsed request to `route` is refused, or None: its sampling fields, then its work."""
    return field_objection(data, limits) or request_work(data, route.rstrip("/") or "/", limits)


def engine_dead(body: bytes) -> bool:
    """Whether the ingress's 500 is for a dead vLLM engine (its error names EngineDeadError or
    EngineGenerateError, vLLM's fatal errors, as Ray's ingress passes them on)."""
    return b"EngineDeadError" in body or b"EngineGenerateError" in body


def unknown_model(data: dict, models: list[str]) -> str | None:
    """Why a request's `model` (of its parsed body, `read_body`) is not served here (None if it is, or
    names none): Serve LLM would route any `<base>:<name>` to the base's engine and fail there with a 500."""
    model = data.get("model")
    if model is None or model in models:
        return None
    return f"the model {model!r} is not served here; this server has: {', '.join(models)}"


# --------------------------------------------------------------------------- cross-origin access


def cors_options(origins: list[str]) -> dict | None:
    """Starlette `CORSMiddleware` options for `http.cors_origins`, or None: no CORS middleware at all.

    Without one no answer carries Access-Control-Allow-Origin, so a web page of another origin cannot read
    the API's answers. Ray Serve LLM's own ingress allows every origin *with credentials* (Starlette then
    echoes the caller's origin): any page a user opens could have driven a key-less server on their machine
    or network. Credentials are allowed only to origins named one by one, never with '*' (any page)."""
    if not origins:
        return None
    return {"allow_origins": list(origins), "allow_credentials": "*" not in origins,
            "allow_methods": ["*"], "allow_headers": ["*"]}


# --------------------------------------------------------------------------- the middleware


HEALTH = "/-/healthz"  # answered by Serve's proxy; never needs the key
RETRY_AFTER_S = 5  # what a client told 503 should wait: a retry then queues for the replacement replica


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
        headers = [(b"content-type", b"application/json")] + ([(b"www-authenticate", b"Bearer")] if status == 401
                                                              else [])
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
        data, problem = read_body(body, self.limits)  # decoded and parsed once, for every check below
        problem = problem or request_objection(data, self.limits, scope.get("path", ""))
        if problem:
            return await self._reply(send, 400, problem, "invalid_request_error")
        missing = unknown_model(data, self.models) if self.models else None
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
