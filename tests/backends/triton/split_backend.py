"""A test-only variant of the triton backend whose builder always takes the split-KV path,
so the conformance suite exercises segments + reduce on its small cases
(``--attnplug-backend split_backend:TritonSplitKVBackend``)."""

from attnplug.backends.triton import SplitKVPolicy, TritonBackend, TritonMetadataBuilder


class AlwaysSplitBuilder(TritonMetadataBuilder):
    split_kv_policy = SplitKVPolicy(max_query_len=1 << 30, min_seq_len=1, min_tokens_per_split=8, max_splits=4)


class TritonSplitKVBackend(TritonBackend):
    @classmethod
    def get_name(cls) -> str:
        return "triton_split_kv"

    @classmethod
    def get_builder_cls(cls):
        return AlwaysSplitBuilder
