from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "reasoning_content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    reasoning_content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., reasoning_content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "chat_template", "presence_penalty", "frequency_penalty", "repetition_penalty", "presence_context_size", "frequency_context_size", "repetition_context_size", "logit_bias", "top_logprobs", "prompt_logprobs", "resume_token_ids", "speculative", "json_schema", "lark_grammar", "regex", "llguidance", "separate_reasoning")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPETITION_CONTEXT_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LARK_GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    LLGUIDANCE_FIELD_NUMBER: _ClassVar[int]
    SEPARATE_REASONING_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    chat_template: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    presence_context_size: int
    frequency_context_size: int
    repetition_context_size: int
    logit_bias: _containers.ScalarMap[int, float]
    top_logprobs: int
    prompt_logprobs: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculative: bool
    json_schema: str
    lark_grammar: str
    regex: str
    llguidance: str
    separate_reasoning: bool
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., chat_template: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_context_size: _Optional[int] = ..., frequency_context_size: _Optional[int] = ..., repetition_context_size: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., speculative: _Optional[bool] = ..., json_schema: _Optional[str] = ..., lark_grammar: _Optional[str] = ..., regex: _Optional[str] = ..., llguidance: _Optional[str] = ..., separate_reasoning: _Optional[bool] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "prefill_tokens_per_sec", "generation_tokens_per_sec", "cached_tokens", "reasoning_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_SEC_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    prefill_tokens_per_sec: float
    generation_tokens_per_sec: float
    cached_tokens: int
    reasoning_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., prefill_tokens_per_sec: _Optional[float] = ..., generation_tokens_per_sec: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage", "top_logprobs", "prompt_token_ids", "prompt_logprobs", "prompt_top_logprobs", "reasoning_text")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    reasoning_text: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., reasoning_text: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankInfo(_message.Message):
    __slots__ = ("rank", "host", "layer_start", "layer_end", "embed", "head", "peak_memory_bytes", "parameter_bytes", "memory_bytes", "memory_limited", "active_memory_bytes", "cache_memory_bytes", "tensor")
    RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARAMETER_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMITED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    rank: int
    host: str
    layer_start: int
    layer_end: int
    embed: bool
    head: bool
    peak_memory_bytes: int
    parameter_bytes: int
    memory_bytes: int
    memory_limited: bool
    active_memory_bytes: int
    cache_memory_bytes: int
    tensor: TensorShare
    def __init__(self, rank: _Optional[int] = ..., host: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., embed: _Optional[bool] = ..., head: _Optional[bool] = ..., peak_memory_bytes: _Optional[int] = ..., parameter_bytes: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., memory_limited: _Optional[bool] = ..., active_memory_bytes: _Optional[int] = ..., cache_memory_bytes: _Optional[int] = ..., tensor: _Optional[_Union[TensorShare, _Mapping]] = ...) -> None: ...

class TensorShare(_message.Message):
    __slots__ = ("rank", "size", "head_start", "head_end", "kv_head_start", "kv_head_end", "experts", "expert_width_start", "expert_width_end")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    HEAD_END_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_END_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WIDTH_START_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WIDTH_END_FIELD_NUMBER: _ClassVar[int]
    rank: int
    size: int
    head_start: int
    head_end: int
    kv_head_start: int
    kv_head_end: int
    experts: int
    expert_width_start: int
    expert_width_end: int
    def __init__(self, rank: _Optional[int] = ..., size: _Optional[int] = ..., head_start: _Optional[int] = ..., head_end: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_end: _Optional[int] = ..., experts: _Optional[int] = ..., expert_width_start: _Optional[int] = ..., expert_width_end: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_context", "max_tokens_cap", "ranks", "max_batch", "kv_bits")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_CAP_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_BITS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_context: int
    max_tokens_cap: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankInfo]
    max_batch: int
    kv_bits: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_tokens_cap: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankInfo, _Mapping]]] = ..., max_batch: _Optional[int] = ..., kv_bits: _Optional[int] = ...) -> None: ...
