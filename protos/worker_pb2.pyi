from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "logprobs", "logit_bias", "prompt_logprobs", "grammar", "pooling", "lora", "allowed_token_ids", "bad_words")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    grammar: str
    pooling: str
    lora: str
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words: _containers.RepeatedCompositeFieldContainer[BadWord]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., pooling: _Optional[str] = ..., lora: _Optional[str] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words: _Optional[_Iterable[_Union[BadWord, _Mapping]]] = ...) -> None: ...

class BadWord(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "prompt_len", "sampling", "block_ids", "num_computed_tokens", "num_scheduled_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    sampling: SamplingParams
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step", "epoch", "new_seqs", "seq_ids", "num_scheduled_tokens", "num_new_blocks", "new_block_ids", "finished_ids", "preempted_ids", "swap_out_blocks", "swap_out_host_blocks", "swap_in_host_blocks", "swap_in_blocks", "offload_blocks", "offload_host_blocks", "released_ids", "num_released_blocks", "unload_loras", "load_loras", "lora_slots", "drop_loras", "load_weights")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IDS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_IDS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_RELEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_LORAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DROP_LORAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    finished_ids: _containers.RepeatedScalarFieldContainer[int]
    preempted_ids: _containers.RepeatedScalarFieldContainer[int]
    swap_out_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_out_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    swap_in_blocks: _containers.RepeatedScalarFieldContainer[int]
    offload_blocks: _containers.RepeatedScalarFieldContainer[int]
    offload_host_blocks: _containers.RepeatedScalarFieldContainer[int]
    released_ids: _containers.RepeatedScalarFieldContainer[int]
    num_released_blocks: _containers.RepeatedScalarFieldContainer[int]
    unload_loras: _containers.RepeatedScalarFieldContainer[str]
    load_loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    lora_slots: _containers.RepeatedCompositeFieldContainer[LoraSlot]
    drop_loras: _containers.RepeatedScalarFieldContainer[str]
    load_weights: str
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., finished_ids: _Optional[_Iterable[int]] = ..., preempted_ids: _Optional[_Iterable[int]] = ..., swap_out_blocks: _Optional[_Iterable[int]] = ..., swap_out_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_host_blocks: _Optional[_Iterable[int]] = ..., swap_in_blocks: _Optional[_Iterable[int]] = ..., offload_blocks: _Optional[_Iterable[int]] = ..., offload_host_blocks: _Optional[_Iterable[int]] = ..., released_ids: _Optional[_Iterable[int]] = ..., num_released_blocks: _Optional[_Iterable[int]] = ..., unload_loras: _Optional[_Iterable[str]] = ..., load_loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., lora_slots: _Optional[_Iterable[_Union[LoraSlot, _Mapping]]] = ..., drop_loras: _Optional[_Iterable[str]] = ..., load_weights: _Optional[str] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class LoraSlot(_message.Message):
    __slots__ = ("slot", "name")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step", "seq_ids", "token_ids", "logprobs", "top_token_ids", "top_logprobs", "forward_ms", "prompt_seq_ids", "prompt_starts", "prompt_counts", "prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs", "grammar_dead_ids", "pooled_seq_ids", "pooled_starts", "pooled_counts", "pooled", "failed_loras", "failed_weights")
    class FailedLorasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_STARTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_DEAD_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    POOLED_STARTS_FIELD_NUMBER: _ClassVar[int]
    POOLED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    POOLED_FIELD_NUMBER: _ClassVar[int]
    FAILED_LORAS_FIELD_NUMBER: _ClassVar[int]
    FAILED_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    forward_ms: float
    prompt_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_starts: _containers.RepeatedScalarFieldContainer[int]
    prompt_counts: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    grammar_dead_ids: _containers.RepeatedScalarFieldContainer[int]
    pooled_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    pooled_starts: _containers.RepeatedScalarFieldContainer[int]
    pooled_counts: _containers.RepeatedScalarFieldContainer[int]
    pooled: _containers.RepeatedScalarFieldContainer[float]
    failed_loras: _containers.ScalarMap[str, str]
    failed_weights: str
    def __init__(self, step: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., forward_ms: _Optional[float] = ..., prompt_seq_ids: _Optional[_Iterable[int]] = ..., prompt_starts: _Optional[_Iterable[int]] = ..., prompt_counts: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_token_ids: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[float]] = ..., grammar_dead_ids: _Optional[_Iterable[int]] = ..., pooled_seq_ids: _Optional[_Iterable[int]] = ..., pooled_starts: _Optional[_Iterable[int]] = ..., pooled_counts: _Optional[_Iterable[int]] = ..., pooled: _Optional[_Iterable[float]] = ..., failed_loras: _Optional[_Mapping[str, str]] = ..., failed_weights: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("protocol_version", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "scheduler_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    scheduler_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("protocol_version", "model", "dtype", "num_blocks", "block_size", "max_model_len", "tensor_parallel_size", "epoch", "vocab_size", "worker_id", "device", "max_num_seqs", "max_num_batched_tokens", "kv_cache_dtype", "num_host_blocks", "sliding_window", "hidden_size", "embedding_only", "lora_adapters", "labels", "label_activation", "max_loras", "max_lora_rank", "max_cpu_loras", "lora_slots", "encoder", "label_pooling", "lora_paths", "dropped_loras", "dropped_lora_paths", "weights_path", "projection_dtype")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_ONLY_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    LABEL_ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    LABEL_POOLING_FIELD_NUMBER: _ClassVar[int]
    LORA_PATHS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_LORAS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_LORA_PATHS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    PROJECTION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: str
    dtype: str
    num_blocks: int
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    epoch: int
    vocab_size: int
    worker_id: str
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str
    num_host_blocks: int
    sliding_window: int
    hidden_size: int
    embedding_only: bool
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.RepeatedScalarFieldContainer[str]
    label_activation: str
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_slots: _containers.RepeatedScalarFieldContainer[str]
    encoder: bool
    label_pooling: str
    lora_paths: _containers.RepeatedScalarFieldContainer[str]
    dropped_loras: _containers.RepeatedScalarFieldContainer[str]
    dropped_lora_paths: _containers.RepeatedScalarFieldContainer[str]
    weights_path: str
    projection_dtype: str
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., epoch: _Optional[int] = ..., vocab_size: _Optional[int] = ..., worker_id: _Optional[str] = ..., device: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., num_host_blocks: _Optional[int] = ..., sliding_window: _Optional[int] = ..., hidden_size: _Optional[int] = ..., embedding_only: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., labels: _Optional[_Iterable[str]] = ..., label_activation: _Optional[str] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., lora_slots: _Optional[_Iterable[str]] = ..., encoder: _Optional[bool] = ..., label_pooling: _Optional[str] = ..., lora_paths: _Optional[_Iterable[str]] = ..., dropped_loras: _Optional[_Iterable[str]] = ..., dropped_lora_paths: _Optional[_Iterable[str]] = ..., weights_path: _Optional[str] = ..., projection_dtype: _Optional[str] = ...) -> None: ...
