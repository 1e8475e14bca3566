"""Helpers shared by the test modules, imported as ``tests.support.<module>``:

- ``tiny``: tiny random Hugging Face causal LMs built from configs, and drafters trained on them;
- ``toy``: a toy target with the SmolLM2 tokenizer saved as a local directory, and conversations
  whose answers it wrote itself;
- ``chat``: a tiny offline chat target (a byte-level tokenizer with a ChatML template);
- ``lossless``: the chi-square check that speculative sampling has the target's distribution;
- ``serving``: a toy target and a drafter trained on it with the contract, fingerprint and held-out
  metrics training writes (what ``eyas serve`` checks and its watchdog predicts from), and its
  classic broken copy (the embeddings prepended as a slot).

``DATA`` is the folder of public prompt-set excerpts that ship with the tests (tests/data, see its
SOURCE.md) and of the engines' metric texts (tests/data/metrics, its own SOURCE.md): the tests read
nothing outside the repository.
"""

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"
