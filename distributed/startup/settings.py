"""run-trinity's settings, read once from the command line (cli.py) into frozen groups:
the model, the prompt and sampling of a one-shot run or chat, the ring, the sizes rank 0
plans with, serving and speculation. Everything below the command line takes these."""

from dataclasses import dataclass, field
from typing import Optional, Union

from .. import TrinityError
from ..runtime.frames import DEFAULT_DRAFT_TOKENS, PREFILL_STEP_SIZE


@dataclass(frozen=True)
class ModelSettings:
    checkpoint: Optional[str] = None  # --model: a folder or a Hugging Face repo id; None: the embedded tiny model

    @property
    def name(self) -> str:
        """The model id the server reports."""
        return self.checkpoint or "trinity-tiny"


@dataclass(frozen=True)
class GenerationSettings:
    """What one run or chat asks for (the prompt flags, sampling, output)."""

    prompt: Optional[str] = None
    prompt_ids: Optional[str] = None  # comma-separated, as given
    chat: bool = False
    no_chat_template: bool = False
    json: bool = False
    max_tokens: int = 100
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None


@dataclass(frozen=True)
class RingSettings:
    """How the ranks join and split the model."""

    stages: int = 1
    split: Optional[str] = None  # "10,12,10", "auto", or None: even
    tensor_parallel_size: int = 1
    transport: str = "auto"
    peer_timeout: float = 5.0
    connect_timeout: float = 60.0


@dataclass(frozen=True)
class SizingSettings:
    """What rank 0 sizes with (startup/sizing.py) and each rank plans its memory with."""

    max_context: Union[int, str, None] = None  # a token count, "auto", or None: the model's
    max_batch: Optional[int] = None  # None: as many as fit
    prefill_step_size: int = PREFILL_STEP_SIZE
    prefill_batch_tokens: int = 2048
    max_step_tokens: Optional[int] = None  # prompt tokens beside decoding rows per step (None: no bound)
    itl_target_ms: Optional[float] = None  # ... or as many as keep a step near this (runtime/step_budget.py)
    memory_limit: Union[int, str, None] = None  # bytes, "auto", or None
    prefix_cache_bytes: Optional[int] = None  # None: a share of the memory
    prefix_cache_dir: Optional[str] = None  # None: the user's cache folder; "none": no disk tier
    prefix_cache_disk_bytes: Optional[int] = None  # None: a share of the disk (disk_cache.default_disk_bytes)
    kv_bits: Optional[int] = None  # the full-attention caches quantized (shard/kv_quant.py); None: whole
    kv_group_size: int = 64
    quantized_kv_start: int = 0


@dataclass(frozen=True)
class ServingSettings:
    """The serving flags as given (cli.py checks them into serving/options.py's ServeOptions)."""

    serve: Optional[str] = None  # gRPC HOST:PORT
    http: Optional[str] = None
    metrics: Optional[str] = None
    auth_token: Optional[str] = None
    insecure: bool = False
    allowed_hosts: Optional[str] = None  # comma-separated, as given
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    max_queue: int = 64
    max_tokens_cap: int = 4096

    @property
    def wanted(self) -> bool:
        """Some front end was asked for."""
        return bool(self.serve or self.http or self.metrics)


@dataclass(frozen=True)
class SpeculationSettings:
    prompt_lookup: bool = False
    draft_model: Optional[str] = None
    speculate: str = "measured"  # or "always"
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    draft_ahead: bool = True

    def options(self):
        """runtime/speculation.py's SpeculationOptions (imported here: the runtime imports mlx_lm,
        which the launcher, reading these settings from rank command lines, never needs)."""
        from ..runtime.speculation import SpeculationOptions

        if self.num_draft_tokens < 1:
            raise TrinityError(f"--num-draft-tokens must be at least 1, got {self.num_draft_tokens}")
        return SpeculationOptions(prompt_lookup=self.prompt_lookup, num_draft_tokens=self.num_draft_tokens,
                                  measured=self.speculate == "measured", ahead=self.draft_ahead)

    def loaded(self, tokenizer):
        """options() with the draft model loaded (rank 0, beside its stage)."""
        from ..shard.draft import load_draft

        options = self.options()
        if self.draft_model:
            options.draft = load_draft(self.draft_model, tokenizer)
        return options


@dataclass(frozen=True)
class Settings:
    """One rank's whole command line."""

    model: ModelSettings = field(default_factory=ModelSettings)
    generation: GenerationSettings = field(default_factory=GenerationSettings)
    ring: RingSettings = field(default_factory=RingSettings)
    sizing: SizingSettings = field(default_factory=SizingSettings)
    serving: ServingSettings = field(default_factory=ServingSettings)
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    log_level: str = "info"
