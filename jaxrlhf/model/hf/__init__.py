"""Hugging Face interop: load Llama / Qwen2 / Mistral / Qwen3 / Gemma 2 / Gemma 3 (text)
checkpoints onto the mesh, export back.

* :func:`config_from_hf` maps a model directory's ``config.json`` (through
  ``transformers.AutoConfig``) onto :class:`~jaxrlhf.config.ModelConfig`.
* :func:`load_hf` reads the safetensors files (one file, or shards with
  ``model.safetensors.index.json``) tensor by tensor and builds every stacked parameter
  straight into its target sharding: each device's block is read from the files (only the rows
  and columns that device owns, layer by layer), converted to the parameter dtype and placed on
  that device.  The host never holds more than one device block at a time, so a checkpoint
  larger than a host's or a device's memory loads.  In a multi-process run each process reads
  only the blocks of its own devices (the directory must be visible to every process).
* :func:`export_hf` writes parameters back as a directory that ``transformers`` (and serving
  engines that read the same format) load: ``config.json``, safetensors shards with an index,
  and the tokenizer files.

Layout.  HF linear weights are ``[out, in]``; ours are ``[in, ...out]`` with heads split out,
e.g. ``q_proj.weight [H*Dh, D]`` is ``wq [D, H, Dh]``.  Our rotary embedding uses the same
half-split (``rotate_half``) convention as HF, so q/k need no permutation.  The ``_LAYER`` and
``_GLOBAL`` tables below say, for each of our parameters, which HF tensor holds it and how that
tensor's dimensions split into our logical axes; loading and export both read them.  Gemma's
norm weights are stored as HF stores them (the ``w`` of ``1 + w``, ``ModelConfig.norm_offset``),
so they load and export unchanged.

Families.  :func:`config_from_hf` sets the fields that tell the families apart (Qwen2's
``qkv_bias``, Qwen3's ``qk_norm``, Gemma's ``norm_offset``, ``post_norms``, GeGLU, embedding
scale, soft-caps, sliding window and layer pattern, Gemma 3's local rotary base); anything a
checkpoint asks for that this model does not compute is an :class:`HFError` naming the
``config.json`` field and what is supported.  :func:`family_of` is the inverse, for export.

Vocabulary padding.  A vocabulary the ``tp`` axis does not divide would leave the embedding and
LM head replicated, so :func:`config_from_hf` pads ``vocab_size`` up to a multiple of ``tp`` and
records the real size in ``unpadded_vocab_size``.  Padded embedding rows and LM-head columns
load as zeros (their logits are 0, so samplers must mask ids >= ``unpadded_vocab_size``);
:func:`export_hf` drops them, so the exported model has the checkpoint's vocabulary again.

Scalar heads.  Reward and value models use the ``"scalar"`` head.  A checkpoint with a
``score.weight [1, D]`` (``*ForSequenceClassification``, ``num_labels=1``) loads it; one without
(a causal LM used to start a reward or value model) gets a zero-initialised head.  HF's
sequence-classification head has no bias: export stores a non-zero ``score.b`` in
``config.json`` as ``jaxrlhf_score_bias`` (read back by :func:`load_hf`; ``transformers`` ignores
it, which shifts every score by that constant).
"""

from jaxrlhf.model.hf.mapping import (  # noqa: F401
    FAMILIES, GEMMA, HFError, INDEX_FILE, SCORE_BIAS_KEY, SINGLE_FILE,
    SUPPORTED_ARCHITECTURES, TOKENIZER_FILES)
from jaxrlhf.model.hf.configs import (  # noqa: F401
    config_from_hf, resolve_hf_config, resolve_models)
from jaxrlhf.model.hf.reading import (  # noqa: F401
    load_hf, load_or_init)
from jaxrlhf.model.hf.export import (  # noqa: F401
    export_hf, family_of)
