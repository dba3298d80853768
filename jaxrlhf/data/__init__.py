"""Data: tokenizers, the built-in verifiable tasks, users' files (JSONL, Parquet, datasets
folders; plain text or chat messages rendered with the tokenizer's template), and fixed-shape
batches.

Every batch uses one layout, shared with the rollout engine: a prompt left-padded to
``P = data.max_prompt_len`` followed by a response right-padded to ``R = data.max_response_len``
(the response ends with EOS).  So the response always starts at column ``P``.

Batches are a pure function of ``(seed, step)``: the data position saved in a checkpoint is the
step, and a resumed run sees exactly the batches it would have seen.
"""

from jaxrlhf.data.tokenizers import (  # noqa: F401
    BOS, CHAR_TOKENIZERS, CharTokenizer, CharToolsTokenizer, EOS, HFTokenizer, PAD, make_tokenizer)
from jaxrlhf.data.examples import (  # noqa: F401
    AdditionTask, Chat, Example)
from jaxrlhf.data.tasks import (  # noqa: F401
    CalculatorTask, GuessTask)
from jaxrlhf.data.files import (  # noqa: F401
    FORMATS, detect_format, read_examples, read_jsonl)
from jaxrlhf.data.encoding import (  # noqa: F401
    Encoder)
from jaxrlhf.data.source import (  # noqa: F401
    DataSource)
