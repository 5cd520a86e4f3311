"""The model: families, selective weight loading, span execution with KV cache, client-side pieces
(embeddings, final norm, LM head) and the default model."""

from blocks import threads
from blocks.cache import MemoryCache, SpanSession, check_left_padding
from blocks.checkpoint import (
    GenerationDefaults,
    generation_defaults,
    load_config,
    model_name,
    resolve_checkpoint,
)
from blocks.client_side import ClientSide, load_client_side
from blocks.errors import (
    BlocksError,
    CacheFull,
    ModelNotFoundError,
    SessionOverflow,
    UnsupportedModelError,
)
from blocks.families import FAMILIES, Family, family_of
from blocks.lora import AdapterError, AdapterInfo, adapter_name, read_adapter
from blocks.memory import block_bytes, cache_bytes_per_block
from blocks.serving import Serving, ServingError, free_memory, resolve_serving
from blocks.span import Span, load_span
from blocks.throughput import Throughput, measure_throughput

__all__ = [
    "FAMILIES",
    "AdapterError",
    "AdapterInfo",
    "BlocksError",
    "CacheFull",
    "ClientSide",
    "Family",
    "GenerationDefaults",
    "MemoryCache",
    "ModelNotFoundError",
    "Serving",
    "ServingError",
    "SessionOverflow",
    "Span",
    "SpanSession",
    "Throughput",
    "UnsupportedModelError",
    "adapter_name",
    "block_bytes",
    "cache_bytes_per_block",
    "check_left_padding",
    "family_of",
    "free_memory",
    "generation_defaults",
    "load_client_side",
    "load_config",
    "load_span",
    "measure_throughput",
    "model_name",
    "read_adapter",
    "resolve_checkpoint",
    "resolve_serving",
    "threads",
]
