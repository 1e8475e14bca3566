"""Hidden states captured by another engine, converted into eyas shards (``eyas import-hidden-states``).

For targets beyond one machine the capture runs in an engine that already spreads a model over
many GPUs and hosts (SGLang, vLLM); eyas converts what it writes. Two formats are read.

**SpecForge offline dumps** (``--format specforge``), written by SpecForge's
``scripts/prepare_hidden_states.py`` (the target inside SGLang) or
``scripts/prepare_hidden_states_hf.py`` (inside transformers: there ``hidden_state`` is
``hidden_states[-1]`` and each captured layer ``hidden_states[id + 1]``, in the order the ids are
given), run with ``--enable-aux-hidden-states``. Layout, as they write it::

    OUTPUT_PATH/rows_0-5000/data_0.ckpt       torch.save of one dict per sample:
    OUTPUT_PATH/rows_0-5000/data_1.ckpt         input_ids         [T]          token ids
    ...                                         loss_mask         [T]          1 = assistant token
    OUTPUT_PATH/rows_5000-10000/data_5000.ckpt  hidden_state      [1, T, H]    the last layer's output
                                                                               AFTER the final norm
                                                aux_hidden_state  [1, T, S*H]  the captured layers,
                                                                               concatenated in layer order

The files do not record which layers were captured: the script captures
``--aux-hidden-states-layers`` (comma-separated; default ``[1, L//2-1, L-4]``), ids passed to
SGLang's ``set_eagle3_layers_to_capture``, which adds 1 to each (the script's own comment says so),
or read as ``hidden_states[id + 1]``: SpecForge's "output of block k" = eyas boundary k+1. (SGLang
since PR #25454 adds the 1 to ids in a drafter's config only when the first id is 1.) So
the converter takes the boundaries from the caller, who names them in eyas' convention or gives the
ids with the convention that reads them (the CLI refuses ids whose readings differ without one).
SpecForge's ``hidden_state`` is the final norm's output, not boundary L, and the norm cannot be
undone: the shards record it in the manifest (``layout.last_hidden_normed``) and training applies
only lm_head to it.

**speculators offline data** (``--format speculators``; speculators 0.9.0, vLLM's
``extract_hidden_states`` speculative method). Three steps write it::

    speculators prepare-data --model M --data conversations.jsonl --render-endpoint http://HOST:8000 \\
        --output DATA                      # tokens and loss masks: a datasets.save_to_disk directory
    python scripts/launch_vllm.py M --target-layer-ids 2 15 27 -- --tensor-parallel-size 8
                                           # vllm serve M --speculative_config {"method":
                                           # "extract_hidden_states", ... "eagle_aux_hidden_state_layer_ids":
                                           # [2, 15, 27, L]} with the ExampleHiddenStatesConnector
    speculators generate-offline-data --preprocessed-data DATA --endpoint http://HOST:8000/v1 \\
        [--output DATA/hidden_states] [--world-size N --rank R]

    DATA/state.json, dataset_info.json, data-*.arrow   columns input_ids [T], loss_mask [T] (1 = trained), seq_len
    DATA/hidden_states/hs_0.safetensors                one file per row of DATA (the name is the row index):
    DATA/hidden_states/hs_1.safetensors                  token_ids      int64 [T]          = the row's input_ids
    ...                                                  hidden_states  dtype [T, S+1, H]  model dtype (bf16)

``hidden_states[:, i]`` is layer id ``i``'s value in layer order (vLLM appends each captured layer
while it runs the blocks). vLLM's id k is the input of block k, ``hidden_states + residual``: eyas
boundary k, the same number. ``launch_vllm.py`` appends ``num_hidden_layers`` (L) to
``--target-layer-ids`` (default ``[2, L//2, L-3]``) unless ``--no-include-last-layer``; vLLM stores
id L as the last block's output BEFORE the final norm (its docs: "not normalized using the output
norm"), which is boundary L, what eyas' own capture stores as ``last_hidden``. speculators' trainer
reads ``hidden_states[:, :-1]`` as the drafter's input and ``hidden_states[:, -1]`` as the
verifier's last hidden state; so does this converter. The loss mask is not in the files: it is the
``loss_mask`` column of the preprocessed dataset (``--preprocessed-data``, by default the directory
above the dump when it is one); reading it needs the ``datasets`` package. With the FP8 backend
(``launch_vllm.py --hidden-states-backend fp8``) ``hidden_states`` is float8_e4m3fn with
``hidden_states_scales`` float32 [T, 1, 1] (value = fp8 * scale); the converter dequantizes it.
Rows without a file (failed requests that speculators skipped, ``--max-samples``) are counted and
left out.

Common to both: the shards get every sample in file order; the manifest's contract holds the
target's identity (from ``--target``), the boundaries, the dtype and the fingerprint of the stored
slots; no tokenisation is recorded (the other tool rendered the chat template itself). Each shard
is written under a temporary name and renamed, then recorded in ``progress-r00.json``; a rerun of
the same import into the same directory keeps the shards already written and goes on (another dump,
target, boundaries, dtype or shard size is refused, naming what differs); the manifest is written
last, once.

Modules: this one holds the entry points (:func:`import_dump`, :func:`import_specforge`,
:func:`import_speculators`) and the options' checks; :mod:`eyas.data.dump_readers` reads the two
formats (finding the files, reading a sample, :class:`~eyas.data.dump_readers.Dump`);
:mod:`eyas.data.dump_to_shards` writes the shards, resumes and writes the manifest
(:func:`~eyas.data.dump_to_shards.convert_dump`). Their public names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from eyas.contract import CaptureContract, Contract, target_identity
from eyas.data.dump_readers import (
    FORMATS,
    SPECFORGE,
    SPECULATORS,
    DumpError,
    open_specforge_dump,
    open_speculators_dump,
    preprocessed_rows,
    read_specforge_sample,
    read_speculators_sample,
    specforge_files,
    speculators_files,
    speculators_slots,
)
from eyas.data.dump_to_shards import ImportSummary, convert_dump
from eyas.data.shard_format import DTYPES

# The public names of the dump modules, importable from here as before the split.
__all__ = [
    "FORMATS", "SPECFORGE", "SPECULATORS", "DumpError", "ImportSummary", "import_dump", "import_specforge",
    "import_speculators", "preprocessed_rows", "read_specforge_sample", "read_speculators_sample",
    "specforge_files", "speculators_files", "speculators_slots",
]


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


def _check_options(bs: list[int], dtype: str, shard_size: int, num_blocks: int) -> None:
    if bs != sorted(set(bs)):
        raise DumpError(f"boundaries: expected ascending and distinct (the engines store the captured layers in "
                        f"layer order), found {bs}")
    if not all(0 <= b <= num_blocks for b in bs):
        raise DumpError(f"boundaries: expected each in 0..{num_blocks} (the target's blocks), found {bs}")
    if dtype not in DTYPES:
        raise DumpError(f"dtype: expected {'|'.join(DTYPES)}, found {dtype!r}")
    if shard_size < 1:
        raise DumpError(f"shard_size: expected at least 1, found {shard_size}")


def _prepare(identity: Any, boundaries: Sequence[int], dtype: str, shard_size: int) -> tuple[Contract, list[int]]:
    bs = [int(b) for b in boundaries]
    _check_options(bs, dtype, shard_size, identity.num_blocks)
    return Contract(target=identity, capture=CaptureContract(boundaries=bs, dtype=dtype)), bs


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------


def import_specforge(
    dump: str | Path,
    out_dir: str | Path,
    target: Any,
    boundaries: Sequence[int],
    *,
    source: str | None = None,
    dtype: str = "bfloat16",
    shard_size: int = 256,
    log: Callable[[str], None] | None = None,
) -> ImportSummary:
    """Convert a SpecForge dump at ``dump`` into eyas shards in ``out_dir`` (new, or an unfinished
    run of this same import, which resumes). ``target`` is the target model (an nn.Module; its
    identity goes into the contract, its H checks every file); ``boundaries`` the captured layers
    in eyas' convention, ascending (the order in which SGLang concatenates them)."""
    contract, bs = _prepare(target_identity(target, source), boundaries, dtype, shard_size)
    return convert_dump(open_specforge_dump(Path(dump), contract.target.hidden_size, bs), Path(out_dir), contract,
                        bs, dtype, shard_size, log)


def import_speculators(
    dump: str | Path,
    out_dir: str | Path,
    target: Any,
    layer_ids: Sequence[int],
    *,
    preprocessed_data: str | Path | None = None,
    source: str | None = None,
    dtype: str = "bfloat16",
    shard_size: int = 256,
    log: Callable[[str], None] | None = None,
) -> ImportSummary:
    """Convert speculators' offline data (``hs_<row>.safetensors`` in ``dump``, loss masks in the
    preprocessed dataset ``preprocessed_data``, by default ``dump``'s parent) into eyas shards in
    ``out_dir`` (new, or an unfinished run of this same import, which resumes). ``layer_ids`` are
    ``launch_vllm.py --target-layer-ids``, with or without the last layer it appends (vLLM's id k is
    eyas boundary k); the slots are those less the last layer, which becomes ``last_hidden``."""
    identity = target_identity(target, source)
    slots = speculators_slots(layer_ids, identity.num_blocks)
    contract, bs = _prepare(identity, slots, dtype, shard_size)
    pre = Path(preprocessed_data) if preprocessed_data is not None else None
    return convert_dump(open_speculators_dump(Path(dump), pre, contract.target.hidden_size, bs), Path(out_dir),
                        contract, bs, dtype, shard_size, log)


def import_dump(fmt: str, dump: str | Path, out_dir: str | Path, target: Any, boundaries: Sequence[int],
                **kwargs: Any) -> ImportSummary:
    """:func:`import_specforge` or :func:`import_speculators` by ``fmt`` (one of :data:`FORMATS`)."""
    if fmt == SPECFORGE:
        if kwargs.pop("preprocessed_data", None) is not None:
            raise DumpError("preprocessed_data: a speculators dump's option; SpecForge's files hold their loss masks")
        return import_specforge(dump, out_dir, target, boundaries, **kwargs)
    if fmt == SPECULATORS:
        return import_speculators(dump, out_dir, target, boundaries, **kwargs)
    raise DumpError(f"format: expected {' | '.join(FORMATS)}, found {fmt!r}")
