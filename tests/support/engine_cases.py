"""Engines over one shared ``ModelRunner`` of the default model, each on its own range of blocks.

``BlockRegion`` lets several ``LLM`` engines share a worker (weights + KV cache) built with
``NUM_BLOCKS`` blocks: blocks ``[0, DEFAULT_REGION)`` belong to a module's default engine and
``make_llm`` builds scratch engines over the rest. ``TEXTS`` are prompts of varied length and
content; ``long_prompt`` cuts or repeats their tokens to an exact length.
"""

from __future__ import annotations

import dataclasses

from folio import LLM, SamplingParams

NUM_BLOCKS = 256   # the shared runner's blocks (num_kv_blocks_override)


class BlockRegion:
    """The shared worker seen through its own range of physical blocks.

    Engines over one worker each have their own block pool and prefix cache; giving each a
    disjoint block range keeps one engine's writes out of blocks another still has cached.
    """

    def __init__(self, runner, offset, num_blocks):
        assert offset + num_blocks <= runner.num_blocks
        self._runner = runner
        self.offset = offset
        self.num_blocks = num_blocks
        self.model_config = runner.model_config
        self.model_dir = runner.model_dir

    def execute(self, plan):
        bs = self._runner.block_size
        slots = plan.slot_mapping.copy()
        slots[slots >= 0] += self.offset * bs
        return self._runner.execute(dataclasses.replace(
            plan, slot_mapping=slots, block_tables=plan.block_tables + self.offset,
            block_copies=plan.block_copies + self.offset))

    def shutdown(self):
        pass


DEFAULT_REGION = 128  # blocks [0, 128) belong to the module's default engine, the rest is scratch


def make_llm(runner, num_blocks=None, **kw):
    """A new engine over the scratch blocks (one scratch engine with caching alive at a time)."""
    region = BlockRegion(runner, DEFAULT_REGION, num_blocks or NUM_BLOCKS - DEFAULT_REGION)
    return LLM(executor=region, device="cpu", **kw)


TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Water boils at",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Q: What is the largest planet in the solar system?\nA:",
    "Hello",
    "The following is a short poem about autumn leaves falling slowly from the trees:\n",
    "In 1969,",
    "SELECT name FROM users WHERE",
    "Translate to French: good morning ->",
    "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z A B C D E F G H I J K L M N O P",
    "Photosynthesis is the process by which",
]

GREEDY2 = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def long_prompt(llm, n):
    """The first ``n`` token ids of ``TEXTS`` joined (repeated until long enough), by ``llm``'s tokenizer."""
    tok = llm.get_tokenizer()
    text = " ".join(TEXTS)
    ids = tok.encode(text)
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]
