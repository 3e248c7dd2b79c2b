"""The model: a transformers decoder's own modules run by the engine, the generator and the teacher alike.

``anatomy`` finds the decoder's submodules; ``decoder`` is the one layer stack over them (with a
pluggable attention and layer math); ``packed`` forwards several chunks of new tokens packed in
one row, each after its own prefix state; ``scoring`` scores whole sequences without gradients
(an OPD teacher's packed forwards); ``graphs`` is how every user captures CUDA graphs.
"""

from __future__ import annotations

from thundersync.model.anatomy import DecoderAnatomy, decoder_anatomy
from thundersync.model.packed import ChunkSpec, KVStack, PackOutput, forward_pack, head_logprobs
from thundersync.model.scoring import PackedScorer

__all__ = [
    "ChunkSpec",
    "DecoderAnatomy",
    "KVStack",
    "PackOutput",
    "PackedScorer",
    "decoder_anatomy",
    "forward_pack",
    "head_logprobs",
]
