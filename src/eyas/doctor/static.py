"""Stage 1, static: the drafter directory read the way the chosen engine reads it, checked against
what the drafter was trained on and against the live target, without running anything.

- what the engine captures (its ids, the +1 rules, its default) versus the trained boundaries;
- each norm flag the engine builds the drafter with versus the trained one, and whether
  config.json states it explicitly (loaders disagree on absent flags: vLLM's speculators loader
  reads an absent ``norm_before_residual`` as true);
- fc input width versus slots x target hidden size, and the width the engine builds fc for;
- vocabulary sizes, the d2t range (every draft id maps into the target vocabulary) and t2d;
- the contract versus the target: weights fingerprint, shape, chat template, special tokens; weights
  that changed behind the same embedding (named per block) only warn: measured acceptance decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from eyas.contract.contract import (
    ADVISORY_FIELDS,
    Contract,
    TargetIdentity,
    changed_count,
    changed_parts,
    compare,
    describe_changes,
    tokenisation_of,
)
from eyas.doctor.common import FAIL, INFO, NORM_FLAGS, OK, WARN, Edit, Stage, boundary_name
from eyas.doctor.infer import BoundaryInference, FlagInference
from eyas.doctor.samples import SampleSet
from eyas.interop import servers
from eyas.interop.common import CONFIG_JSON, EYAS_JSON
from eyas.interop.directory import DrafterDir
from eyas.interop.engines import boundary_edits, read_as
from eyas.interop.servers import EngineReading, flag_edit

if TYPE_CHECKING:
    from eyas.doctor.context import DoctorContext

_PROBE = "eyasDoctorProbe7c1"


@dataclass(frozen=True)
class SystemPromptDrift:
    """How the start of a training sequence differs from what the chat template renders now."""

    training_prefix: str  # the training text before the first user message
    template_prefix: str  # what this template renders there
    training_system_prompt: str | None  # the system prompt training had and the template lacks, when recoverable

    def to_dict(self) -> dict[str, Any]:
        return {"training_prefix": self.training_prefix, "template_prefix": self.template_prefix,
                "training_system_prompt": self.training_system_prompt}


@dataclass(frozen=True)
class TrainedView:
    """What the drafter was trained with, and where that was read."""

    boundaries: list[int]
    boundaries_source: str
    flags: dict[str, bool]
    flags_source: str
    inference: BoundaryInference | None = None  # assumed boundaries, decided (or not) from live accuracy
    flag_inferences: dict[str, FlagInference] | None = None  # assumed norm flags, decided (or not) likewise

    def to_dict(self) -> dict[str, Any]:
        inf = {"inference": self.inference.to_dict()} if self.inference is not None else {}
        if self.flag_inferences:
            inf["flag_inferences"] = {k: v.to_dict() for k, v in self.flag_inferences.items()}
        return {"boundaries": self.boundaries, "boundaries_source": self.boundaries_source, "flags": self.flags,
                "flags_source": self.flags_source, **inf}


@dataclass
class StaticResult:
    """The static stage's two views of the directory: as the engine serves it, and as it was trained."""

    engine: EngineReading  # the served view
    trained: TrainedView
    captures: dict[str, list[int] | str | None]  # per engine setting: the boundaries it captures, or why it cannot load
    layout: str
    format: str | None
    system_prompt_drift: SystemPromptDrift | None = None

    def to_dict(self) -> dict[str, Any]:
        drift = {"system_prompt_drift": self.system_prompt_drift.to_dict()} if self.system_prompt_drift else {}
        return {**drift, "engine": self.engine.to_dict(), "trained": self.trained.to_dict(), "captures": self.captures,
                "layout": self.layout, "format": self.format}


def _retrain_fix(contract: Contract) -> str:
    src = f" ({contract.target.source})" if contract.target.source else ""
    return (f"serve the drafter with the target it was trained for{src}, weights fingerprint "
            f"{contract.target.fingerprint}, or train a drafter for this target")


def system_prompt_drift(tokenizer: Any, training_ids: torch.Tensor | None) -> SystemPromptDrift | None:
    """How the start of a training sequence differs from what this chat template renders before
    the first user message. None when they agree or cannot be compared."""
    if training_ids is None or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        live = tokenizer.apply_chat_template([{"role": "user", "content": _PROBE}], tokenize=False)
        with_sys = tokenizer.apply_chat_template(
            [{"role": "system", "content": _PROBE + "S"}, {"role": "user", "content": _PROBE}], tokenize=False)
    except Exception:  # noqa: BLE001 - templates may reject roles
        return None
    live_prefix = live.split(_PROBE)[0]
    text = tokenizer.decode(training_ids.tolist(), skip_special_tokens=False)
    if text.startswith(live_prefix):
        return None
    # The user header is the longest tail of the live prefix that occurs in the training text.
    header = next((live_prefix[j:] for j in range(len(live_prefix)) if live_prefix[j:] and live_prefix[j:] in text), "")
    if not header:
        return SystemPromptDrift(text[:120], live_prefix, None)
    training_prefix = text[: text.find(header)]
    template_prefix = live_prefix[: len(live_prefix) - len(header)]
    system_text = None
    pre = with_sys.split(_PROBE + "S")
    if len(pre) == 2 and training_prefix.startswith(pre[0]):
        after = pre[1].split(_PROBE)[0]  # the system block's closing text (+ the user header)
        closing = after[: len(after) - len(header)] if after.endswith(header) else after
        body = training_prefix[len(pre[0]):]
        system_text = body[: body.find(closing)] if closing and closing in body else body
    return SystemPromptDrift(training_prefix, template_prefix, system_text)


def _check_boundaries(st: Stage, dd: DrafterDir, r: EngineReading, L: int, trained: list[int], source: str) -> None:
    spec = servers.get(r.engine)
    if r.refused_layout is not None:
        st.add(FAIL, "engine_cannot_load", f"{r.label} cannot load {dd.path}: {r.why_not}",
               fix=f"export the drafter for {spec.title}: eyas export {dd.path} --to {r.engine} "
                   f"--out {dd.path}-{r.engine}")
        return
    if not spec.can_capture(trained, L):
        st.add(FAIL, "uncapturable", f"the drafter was trained on {trained}, whose boundary {L} (the last block's "
               f"output) {r.label} never captures: it captures block inputs only (boundaries 0..{L - 1})",
               field="boundaries", expected=trained, found=r.boundaries,
               fix=f"retrain the drafter on boundaries 0..{L - 1} (eyas train --boundaries), or serve it with eyas")
        return
    if r.boundaries != trained:
        edits, problem = boundary_edits(dd, r, trained, L)
        if r.boundaries is None:
            msg = f"{r.label} cannot use the layer ids: {r.boundaries_note}"
        else:
            diff = "; ".join(f"slot {i}: trained on {boundary_name(t, L)}, served {boundary_name(s, L)}"
                             for i, (t, s) in enumerate(zip(trained, r.boundaries)) if t != s)
            msg = (f"{r.label} captures boundaries {r.boundaries} ({r.boundaries_note}); the drafter was trained on "
                   f"{trained} (from {source}): {diff}")
            if not r.loadable:
                msg += f"; {r.why_not}"
        if problem:
            msg += f"; no id list makes this {spec.title} capture {trained}: {problem}"
        st.add(FAIL, "boundaries", msg, field="boundaries", expected=trained, found=r.boundaries, edits=edits,
               fix=problem)
    else:
        which = "the assumed trained ones" if source == dd.meta.boundaries_source and dd.meta.boundaries_assumed \
            else "the trained ones"
        st.add(OK, "boundaries", f"{r.label} captures boundaries {r.boundaries}, {which} ({r.boundaries_note})")
    for other in spec.rules:  # an engine whose versions read ids differently: each other version
        if other == r.rule:
            continue
        o = read_as(r.engine, dd, L, other)
        if o.boundaries != trained:
            agnostic = spec.rule_agnostic_ids(trained, L)
            advice = (f"write {agnostic}, which both rules read as {trained}" if agnostic is not None
                      else spec.rules_disagree_note)
            got = o.boundaries if o.boundaries is not None else o.boundaries_note
            st.add(WARN, f"{r.engine}_rule", f"an {spec.title} following the {other} rule would capture {got} "
                   f"from these ids; {advice}",
                   edits=boundary_edits(dd, o, trained, L)[0] if agnostic is not None else [])


def _check_flags(st: Stage, dd: DrafterDir, r: EngineReading, inferred: dict[str, FlagInference]) -> None:
    """Each norm flag the engine builds with against the trained one (``dd.trained``: eyas.json, else
    config.json and the weights, with any flag the drafter's live prediction settled otherwise,
    ``inferred``); flags a converter chose are confirmed, or warned about as assumed."""
    if not r.flags:
        return
    for flag in NORM_FLAGS:
        served, trained = r.flags[flag], getattr(dd.trained, flag)
        present = flag in dd.config
        where = (f"config.json says {str(dd.config[flag]).lower()}" if present
                 else f"absent from config.json, {r.label} reads {str(served).lower()}")
        if r.engine == "eyas" and dd.meta.drafter_config is not None:
            where = "eyas.json drafter_config"
        weights = ""
        if flag == "norm_before_fc":
            has = "input_norm.weight" in dd.tensors
            weights = " (the weights contain input_norm.weight)" if has else ""
        if served != trained:
            st.add(FAIL, f"flag:{flag}",
                   f"{r.label} builds the drafter with {flag}={str(served).lower()} ({where}); it was trained with "
                   f"{flag}={str(trained).lower()} ({dd.trained_source}){weights}",
                   field=flag, expected=trained, found=served, edits=[flag_edit(flag, trained)])
        elif not present:
            st.add(WARN, f"implicit:{flag}",
                   f"config.json does not state {flag}: {r.label} reads {str(served).lower()}, as trained, but loaders "
                   f"disagree on absent flags (vLLM's speculators loader reads an absent norm_before_residual as true); "
                   f"write it explicitly", field=flag, expected=trained, found=None, edits=[flag_edit(flag, trained)])
    for flag, why in dd.meta.flags_assumed.items():
        fi = inferred.get(flag)
        written = bool(dd.config.get(flag, False)) if flag in dd.config else r.flags[flag]
        if fi is not None and fi.decided is not None and fi.decided == written:
            st.add(INFO, f"flag_confirmed:{flag}", f"{flag}={str(written).lower()} as config.json says, though a "
                   f"converter chose it ({why}); the drafter's live prediction confirms it: {fi.why}",
                   field=flag, expected=written, found=written)
        elif fi is None or fi.decided is None:
            tried = (f"; the drafter's live prediction cannot decide: {fi.why}" if fi is not None
                     else "; give the doctor conversations (--data) to measure it")
            st.add(WARN, f"flag_assumed:{flag}", f"{flag}={str(written).lower()} is assumed, not known to be the "
                   f"trained value: {why}{tried}", field=flag, expected=None, found=written,
                   fix=f"if the drafter was trained with {flag}={str(not written).lower()}, set \"{flag}\": "
                       f"{str(not written).lower()} in {dd.path / CONFIG_JSON}")
        # decided otherwise: dd.trained holds the measured value, and the comparison above fails on it
    unsettled = [f for f in dd.meta.flags_assumed if inferred.get(f) is None or inferred[f].decided is None]
    if all(r.flags[f] == getattr(dd.trained, f) for f in NORM_FLAGS):
        st.add(OK, "flags", f"{r.label} builds the drafter with the trained norm flags "
               + ", ".join(f"{f}={str(r.flags[f]).lower()}" for f in NORM_FLAGS)
               + (f" ({', '.join(unsettled)} as assumed above)" if unsettled else ""))


def _check_shapes(st: Stage, dd: DrafterDir, r: EngineReading, H: int, V: int) -> None:
    t = dd.tensors
    fc = t.get("fc.weight")
    fc_in = int(fc.shape[1]) if fc is not None and fc.dim() == 2 else None
    if r.target_hidden_size is not None and r.target_hidden_size != H:
        st.add(FAIL, "target_hidden_size", f"{r.label} reads target_hidden_size {r.target_hidden_size}; the target's "
               f"hidden size is {H}", field="target_hidden_size", expected=H, found=r.target_hidden_size)
    if fc_in is None:
        st.add(FAIL, "fc_width", "the weights have no 2-D fc.weight")
    elif r.boundaries is not None:
        want = len(r.boundaries) * H
        if fc_in != want:
            st.add(FAIL, "fc_width", f"fc takes {fc_in} features ({fc_in / H:g} slots x {H}); {r.label} feeds it "
                   f"{len(r.boundaries)} boundaries x {H} = {want}", field="fc.in_features", expected=want, found=fc_in)
        elif r.fc_slots is not None and r.target_hidden_size and fc_in != r.fc_slots * r.target_hidden_size:
            st.add(FAIL, "fc_width", f"{r.label} builds fc for {r.fc_slots} x target_hidden_size = "
                   f"{r.fc_slots * r.target_hidden_size} features; the weights have {fc_in}",
                   field="fc.in_features", expected=r.fc_slots * r.target_hidden_size, found=fc_in)
        else:
            st.add(OK, "fc_width", f"fc input {fc_in} = {len(r.boundaries)} slots x {H}")
    # vocabularies
    if r.vocab_size is not None and r.vocab_size != V:
        st.add(FAIL, "vocab_size", f"config.json vocab_size {r.vocab_size}; the target's vocabulary has {V} ids",
               field="vocab_size", expected=V, found=r.vocab_size)
    head = t.get("lm_head.weight")
    rows = int(head.shape[0]) if head is not None else None
    if rows is not None and r.draft_vocab_size is not None and rows != r.draft_vocab_size:
        st.add(FAIL, "draft_vocab_size", f"{r.label} sizes lm_head for draft_vocab_size {r.draft_vocab_size}; the "
               f"weights have {rows} rows", field="draft_vocab_size", expected=rows, found=r.draft_vocab_size,
               edits=[Edit(CONFIG_JSON, "draft_vocab_size", rows)])
    emb = t.get("embed_tokens.weight")
    if emb is not None and emb.shape[0] != V:
        st.add(FAIL, "embedding", f"the saved embed_tokens has {emb.shape[0]} rows; the target's vocabulary {V}")
    d2t, t2d = t.get("d2t"), t.get("t2d")
    n_draft = rows or dd.trained.draft_vocab_size
    if d2t is None:
        if n_draft != V:
            st.add(FAIL, "d2t", f"no d2t in the weights but the draft vocabulary ({n_draft}) is smaller than the "
                   f"target's ({V}): draft id i would be read as target id i")
    else:
        target_ids = d2t.long() + torch.arange(d2t.shape[0])
        bad = int(((target_ids < 0) | (target_ids >= V)).sum())
        dupes = int(target_ids.numel() - target_ids.unique().numel())
        if bad:
            st.add(FAIL, "d2t", f"d2t maps {bad} of {d2t.shape[0]} draft ids outside the target vocabulary 0..{V - 1}")
        elif dupes:
            st.add(FAIL, "d2t", f"d2t maps {dupes} draft ids onto target ids already taken")
        elif t2d is not None and (t2d.numel() != V or int(t2d.bool().sum()) != d2t.shape[0]
                                  or not bool(t2d.bool()[target_ids].all())):
            st.add(FAIL, "t2d", f"t2d ({int(t2d.bool().sum())} of {t2d.numel()} set) is not the set of target ids d2t "
                   f"maps to ({d2t.shape[0]})")
        else:
            st.add(OK, "vocab", f"draft vocabulary {d2t.shape[0]} ids, all inside the target's {V}; t2d consistent")


def _check_contract(st: Stage, dd: DrafterDir, identity: TargetIdentity, tokenizer: Any,
                    samples: SampleSet | None) -> SystemPromptDrift | None:
    """The contract against the live target; returns the system prompt drift when the template differs."""
    c = dd.contract
    drift = None
    if c is None:
        st.add(WARN, "no_contract", f"{dd.path} has no eyas.json contract: the target, chat template and training "
               f"accuracy cannot be checked (`eyas import --target` records one)")
        return drift
    mode = c.tokenisation.system_prompt if c.tokenisation else "template_default"
    live = Contract(target=identity, capture=c.capture,
                    tokenisation=tokenisation_of(tokenizer, mode) if tokenizer is not None else None)
    mismatches = compare(c, live)
    weights_mm = [m for m in mismatches if m.field == "target.weights"]
    target_mm = [m for m in mismatches if m.field.startswith("target.") and m.field != "target.weights"]
    tok_mm = [m for m in mismatches if m.field.startswith("tokenisation.")]
    same_shape = [m.field for m in target_mm] == ["target.fingerprint"]
    for m in target_mm:
        what = "another checkpoint of the same shape" if same_shape else "another model"
        parts = changed_parts(c.target, identity) if m.field == "target.fingerprint" else None
        named = f" ({describe_changes(parts)})" if parts else ""
        st.add(FAIL, "target_mismatch", f"{m}: the target is {what}{named}, not the one the drafter was trained for",
               field=m.field, expected=m.expected, found=m.found, fix=_retrain_fix(c))
    if weights_mm and not target_mm:
        # The recorded target with some parts changed (a merged LoRA, a fine-tune that froze the embeddings,
        # a retouched embedding or final norm: at most half of the parts, contract.modified_copy): the
        # drafter may still read the target well, so measured acceptance decides.
        m = weights_mm[0]
        counts = changed_count(c.target, identity)
        share = f"{counts[0]} of its {counts[1]} parts" if counts else "some parts"
        same_fp = identity.fingerprint == c.target.fingerprint
        behind = (f"the embedding and final norm match, fingerprint {c.target.fingerprint}" if same_fp else
                  f"weights fingerprint {identity.fingerprint}, recorded {c.target.fingerprint}: the embedding "
                  f"or final norm changed, but {share} is a modified copy of the recorded target, not another model")
        st.add(WARN, "target_changed", f"the target's weights differ from those the drafter was trained for: "
               f"{m.found} ({share}; {behind}); the verdict rests on the measured acceptance",
               field=m.field, expected=m.expected, found=m.found)
    elif c.target.weights is None and not target_mm:
        st.add(INFO, "target_blocks_unrecorded", "the contract records no per-block weights sample (an eyas.json "
               "written before it): only the embedding and the final norm are compared")
    if tok_mm:
        if samples is not None and samples.source == "shards" and samples.samples:
            drift = system_prompt_drift(tokenizer, samples.samples[0].input_ids)
        for m in tok_mm:
            msg = f"{m}"
            fix = "serve with the chat template the drafter was trained with"
            if m.field == "tokenisation.chat_template_sha256":
                msg = f"the target's chat template differs from training (sha256 {m.expected}, found {m.found})"
                if drift is not None:
                    sp = drift.training_system_prompt
                    msg += (f": training sequences begin with {drift.training_prefix!r} before the first user "
                            f"message, this template renders {drift.template_prefix!r}")
                    if sp:
                        msg += f" (the training system prompt {sp!r} is missing)"
                        fix = (f"restore the training chat template (sha256 {m.expected}) in the target's "
                               f"tokenizer files, or send the system prompt {sp!r} with every request")
            if m.field in ADVISORY_FIELDS:  # where generation stops, not what the drafter sees
                st.add(WARN, "eos_mismatch", f"{m}: serving stops generation at another token than the training "
                       f"answers did; the drafter's inputs are unaffected", field=m.field, expected=m.expected,
                       found=m.found)
                continue
            st.add(FAIL, "template_mismatch", msg, field=m.field, expected=m.expected, found=m.found, fix=fix)
    if all(m.field in ADVISORY_FIELDS and m.field != "target.weights" for m in mismatches):
        st.add(OK, "contract", f"the target matches the contract (weights fingerprint {c.target.fingerprint}, "
               f"{c.target.num_blocks} blocks, hidden {c.target.hidden_size}, vocab {c.target.vocab_size}; "
               f"chat template and special tokens)")
    if max(dd.boundaries) > c.target.num_blocks:
        st.add(FAIL, "boundaries_range", f"trained boundaries {dd.boundaries} exceed the target's {c.target.num_blocks} blocks")
    _check_fingerprint_boundaries(st, dd, c)
    return drift


def shift_name(recorded: list[int], measured: list[int]) -> str | None:
    """How ``recorded`` boundaries relate to ``measured`` ones, in the words of the classic mistakes."""
    if len(recorded) != len(measured):
        return None
    if recorded == [0] + measured[:-1]:
        return "the embeddings (boundary 0) prepended as a slot, the last slot dropped"
    if recorded == [0] + measured[1:]:
        return "the embeddings (boundary 0) in place of slot 0"
    for d in (1, -1):
        if recorded == [b + d for b in measured]:
            return f"every boundary {'one block late' if d > 0 else 'one block early'} (the other layer-id convention)"
    return None


def _check_fingerprint_boundaries(st: Stage, dd: DrafterDir, c: Contract) -> None:
    """The training fingerprint is measured on the captured training data, slot by slot, each with
    the boundary it was captured at: it is the one record of what the drafter was trained on that an
    edit of the boundaries in eyas.json does not move. Recorded boundaries that disagree with it
    serve the drafter other hidden states than it was trained on."""
    if not c.fingerprint:
        return
    measured = [f.boundary for f in c.fingerprint]
    recorded = list(dd.boundaries)
    if measured == recorded:
        return
    how = shift_name(recorded, measured)
    st.add(FAIL, "fingerprint_boundaries",
           f"{EYAS_JSON} records boundaries {recorded}, but its training fingerprint was measured at boundaries "
           f"{measured}: the drafter was trained on {measured}" + (f"; the recorded ones are {how}" if how else ""),
           field="boundaries", expected=measured, found=recorded,
           edits=[Edit(EYAS_JSON, "boundaries", measured), Edit(EYAS_JSON, "contract.capture.boundaries", measured)])


def _check_data(st: Stage, dd: DrafterDir, samples: SampleSet | None) -> None:
    if samples is None or samples.manifest_contract is None:
        return
    mc = samples.manifest_contract
    if samples.stored_boundaries != dd.boundaries and dd.contract is None:
        st.add(WARN, "shards_boundaries", f"the shards hold boundaries {samples.stored_boundaries}; {dd.path} by its "
               f"own convention says {dd.boundaries} ({dd.meta.boundaries_source}): replay runs on the shards")
    elif samples.stored_boundaries != dd.boundaries:
        st.add(WARN, "shards_boundaries", f"the shards hold boundaries {samples.stored_boundaries}; the drafter was "
               f"trained on {dd.boundaries}: replay recaptures the trained boundaries from the live target instead")
    if dd.contract is None:
        return
    parts = changed_parts(dd.contract.target, mc.target)
    if mc.target.fingerprint != dd.contract.target.fingerprint:
        st.add(WARN, "shards_target", f"the shards were captured from another target (fingerprint "
               f"{mc.target.fingerprint}) than the drafter's ({dd.contract.target.fingerprint})"
               + (f": {describe_changes(parts)}" if parts else ""))
    elif parts:
        st.add(WARN, "shards_target", f"the shards were captured from a target whose weights differ from the "
               f"drafter's behind the same embedding and final norm: {describe_changes(parts)}")


def static_stage(ctx: DoctorContext) -> Stage[StaticResult]:
    """The directory as the engine reads it, against the trained boundaries (``ctx.trained``: the
    directory's own, or its training shards' when it has no contract, or those the drafter's live
    accuracy decided when nothing recorded them, which ``ctx.trained_note`` says), the trained
    flags, the shapes, the contract and the data, without running the drafter (the live accuracy
    behind inferred boundaries or flags was measured before the stages, DoctorContext.settle_assumed)."""
    dd, reading, tokenizer, samples = ctx.dd, ctx.served, ctx.tokenizer, ctx.samples
    # (third-party ids whose conventions disagree, none named: the trained boundaries are assumed,
    # which a warning says unless the training shards settle them)
    L, H, V = ctx.target.num_blocks, ctx.target.hidden_size, ctx.target.vocab_size
    trained, trained_note = ctx.trained, ctx.trained_note
    st: Stage[StaticResult] = Stage("static")
    for p in dd.problems:
        st.add(WARN, "checkpoint", p)
    inference = ctx.inference
    inferred = inference is not None and inference.decided is not None and trained == inference.decided
    if inferred:
        assert inference is not None
        st.add(INFO, "boundaries_inferred", trained_note or "", field="boundaries", found=trained)
    elif trained_note:
        st.add(INFO, "trained_from_shards", trained_note)
    elif dd.meta.boundaries_assumed:  # nothing here settles what the ids meant: never call them verified
        tried = (f"; the drafter's live accuracy on {inference.data} cannot decide between the candidate boundary "
                 f"sets: {inference.why}" if inference is not None else "")
        st.add(WARN, "boundaries_assumed", f"the trained boundaries {trained} are assumed, not recorded: "
               f"{dd.meta.boundaries_assumed}{tried}; what settles it: the training shards (--data), an eyas.json, "
               f"or conversations (--data) on which the drafter's live accuracy clearly prefers one boundary set")
    source = (f"live accuracy on {inference.data}" if inferred and inference is not None
              else "the training shards" if trained_note else dd.meta.boundaries_source)
    _check_boundaries(st, dd, reading, L, trained, source)
    _check_flags(st, dd, reading, ctx.flag_inferences)
    _check_shapes(st, dd, reading, H, V)
    drift = _check_contract(st, dd, ctx.loaded.identity, tokenizer, samples)  # weights hashed once per run
    _check_data(st, dd, samples)
    captures = {}
    for spec, rule in servers.readings():
        o = read_as(spec.name, dd, L, rule)
        captures[o.label] = o.boundaries if o.loadable else f"cannot load: {o.why_not}"
    st.result = StaticResult(engine=reading, trained=TrainedView(trained, source, dd.trained_flags, dd.trained_source,
                                                                 inference, dict(ctx.flag_inferences)),
                             captures=captures, layout=dd.layout, format=dd.meta.format, system_prompt_drift=drift)
    fails = st.failures()
    return st.settle(f"{len(fails)} problem(s): " + "; ".join(f.code for f in fails) if fails
                     else "config, shapes, vocabulary and contract agree with training and the target")
