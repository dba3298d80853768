"""Per-token log-prob of a target and entropy, from hidden states and the unembedding, without
materialising ``[batch, seq, vocab]`` logits.  One entry point: :func:`logprob_entropy`."""

from kernels.logprob.dispatch import IMPLS, logprob_entropy
from kernels.logprob.mosaic import BlockSizes as MosaicBlockSizes
from kernels.logprob.mosaic import logprob_entropy_mosaic
from kernels.logprob.pallas import BlockSizes, logprob_entropy_pallas
from kernels.logprob.reference import logprob_entropy_reference
from kernels.logprob.xla import logprob_entropy_blockwise

__all__ = ["logprob_entropy", "logprob_entropy_reference", "logprob_entropy_blockwise",
           "logprob_entropy_pallas", "BlockSizes", "logprob_entropy_mosaic", "MosaicBlockSizes",
           "IMPLS"]
