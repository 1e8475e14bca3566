"""The prompt mix of a SmolLM2 drafter run (``train_smollm2_drafter.py``'s first stages).

Three sources of prompts, and one file that mixes them:

- ``prepare`` (CPU, here): the first user turn of every record of ``../shared/data``'s training
  sets (:data:`SOURCES`, each capped), de-duplicated, shuffled, a share given a generic second turn
  (:data:`FOLLOW_UPS`), 24 held out for the tau probe.
- :func:`grow` (GPU, in ``run``): the target writes prompts itself with ``eyas prompts``: Magpie
  user turns (``--magpie N``), then requests about long documents (``--documents docs.jsonl
  --doc-prompts K``: the prompt is the document and the request, so serving's long contexts are in
  the mix). Each is killed at its share of ``--grow-budget-s``; what it wrote stays (the files resume).
- :func:`mix`: the parts (the ``prepare`` file, ``eyas open-prompts``' file, the grown files), each
  shuffled, interleaved by weight (a round robin by Sainte-Lague's divisors), so that **any prefix of the
  mix holds the parts in the weights' proportions** (a regeneration killed at its deadline answers a
  prefix, and still a balanced one). A part that runs out drops out and the others share its turns.
  Single-turn prompts of a part with ``follow_ups`` get a generic second turn at ``follow_up_share``.
  The report counts each part and estimates the share of prompts over 1,000 tokens of the target's
  tokenizer from a seeded sample (tokenizing every long document takes minutes; ``sample=0``
  counts every prompt).
"""

from __future__ import annotations

import gzip
import heapq
import json
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

# (folder/file under shared/data, how many prompts at most, licence). The caps balance the mix
# against the six EAGLE evaluation sets (chat, code, math, instructions, summaries, questions);
# the evaluation prompts themselves are never trained on.
SOURCES: list[tuple[str, int, str]] = [
    ("sharegpt_prompts/ShareGPT_V3_filtered_500.json", 500, "Apache-2.0 repo; ShareGPT terms unclear"),
    ("sharegpt_prompts/ShareGPT_V3_filtered_1000.json", 1000, "Apache-2.0 repo; ShareGPT terms unclear"),
    ("sharegpt_prompts/sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json", 2978,
     "Apache-2.0 repo; ShareGPT terms unclear"),
    ("gpteacher/codegen_prompts.jsonl", 4535, "MIT"),
    ("gpteacher/roleplay_prompts.jsonl", 1923, "MIT"),
    ("gsm8k/train.jsonl", 3000, "MIT"),  # capped: 7,473 math word problems would outweigh the chat sets
    ("self_instruct/seed_tasks.jsonl", 175, "Apache-2.0"),
    ("self_instruct/user_oriented_instructions.jsonl", 252, "Apache-2.0"),
    ("arena_hard/v0.1_question.jsonl", 500, "Apache-2.0"),
]

# Every source holds first turns only. MT-bench (and chat in general) asks a second question about
# the first answer, so a share of the prompts gets one of these generic follow-ups as a second user
# turn; `eyas regenerate --max-turns 2` answers it after the target's own first answer.
FOLLOW_UPS: list[str] = [
    "Can you explain that in more detail?",
    "Please summarise your answer in three bullet points.",
    "Rewrite your answer so that a ten-year-old could understand it.",
    "Give a concrete example.",
    "What are the limitations or possible mistakes in your answer?",
    "Now make it shorter and more formal.",
    "Can you continue?",
    "Turn your answer into a short table.",
]


def log(msg: str) -> None:
    print(f"[train_smollm2 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# prepare: the prompt mix (CPU, here)
# ---------------------------------------------------------------------------------------------


def prepare(shared: Path, out: Path, seed: int, no_sharegpt: bool, max_chars: int,
            follow_up_share: float = 0.3, val_prompts: int = 24) -> dict[str, Any]:
    """First user turn of every source record (system message kept when it leads), de-duplicated by
    text, at most ``cap`` per source, shuffled (any prefix is a mix), as OpenAI-style JSONL; a
    ``follow_up_share`` of them (seeded) get a second user turn from FOLLOW_UPS. The first
    ``val_prompts`` of the shuffled mix are held out (first turn only) into ``val_prompts.jsonl``
    next to ``out``: training measures the engine's tau on them and never trains on them."""
    from eyas.data.conversation_files import read_conversations

    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, Any]] = []
    counts: dict[str, dict[str, Any]] = {}
    for rel, cap, licence in SOURCES:
        if no_sharegpt and rel.startswith("sharegpt"):
            continue
        path = shared / rel
        if not path.exists():
            log(f"prepare: {path} missing, skipped")
            continue
        convs = read_conversations(path, on_error="skip").conversations
        picked = []
        for i, c in enumerate(convs):
            users = [m for m in c.messages if m["role"] == "user"]
            if not users:
                continue
            text = users[0]["content"].strip()
            if not text or len(text) > max_chars or text in seen:
                continue
            seen.add(text)
            head = [m for m in c.messages[:1] if m["role"] == "system"]
            picked.append({"id": f"{Path(rel).parent.name}/{Path(rel).stem}:{c.id or i}", "messages": head + [{"role": "user", "content": text}]})
        rng.shuffle(picked)
        picked = picked[:cap]
        rows += picked
        counts[rel] = {"records": len(convs), "kept": len(picked), "licence": licence}
    rng.shuffle(rows)
    held_out, rows = rows[:val_prompts], rows[val_prompts:]
    val_path = out.with_name("val_prompts.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    val_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in held_out), encoding="utf-8")
    follow_ups = 0
    for r in rows:
        if rng.random() < follow_up_share:
            r["messages"].append({"role": "user", "content": rng.choice(FOLLOW_UPS)})
            follow_ups += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(out)
    info = {"prompts": len(rows), "with_follow_up": follow_ups, "val_prompts": len(held_out), "bytes": out.stat().st_size, "seed": seed, "max_chars": max_chars,
            "shared": str(shared), "sources": counts}
    out.with_name(out.stem + ".sources.json").write_text(json.dumps(info, indent=2))
    log(f"prepare: wrote {len(rows)} prompts ({info['bytes'] / 2**20:.2f} MiB) to {out}")
    for rel, c in counts.items():
        log(f"  {rel}: {c['kept']} of {c['records']} ({c['licence']})")
    return info


# ---------------------------------------------------------------------------------------------
# grow: the target writes prompts (GPU), then mix
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MixPart:
    """One file of the mix: ``weight`` is its share of the interleaving (relative to the others)."""

    name: str
    path: Path
    weight: float
    follow_ups: bool = False  # give a share of its single-turn prompts a generic second turn


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """The records of a prompts JSONL (``messages`` ending with a user turn); a torn last line (a
    killed writer) is skipped, any other bad line named with its file and line."""
    rows: list[dict[str, Any]] = []
    lines = path.read_text(encoding="utf-8").split("\n")  # not splitlines(): U+2028 is no line end in JSON
    while lines and not lines[-1].strip():
        lines.pop()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines):
                continue  # the last line of a file whose writer was killed
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not msgs or msgs[-1].get("role") != "user":
            raise ValueError(f"{path}:{i}: messages: expected a list ending with a user turn, found {str(msgs)[:80]!r}")
        rows.append(rec)
    return rows


def interleave(groups: dict[str, list[Any]], weights: dict[str, float]) -> list[tuple[str, Any]]:
    """Weighted round robin by Sainte-Lague's divisors: the next item comes from the group whose
    (taken + 1/2) / weight is smallest (ties: the group named first), so after n items every group
    still holding items has taken within one of n x its share. A group that runs out drops out.
    -> [(group, item)]."""
    if any(w <= 0 for w in weights.values()):
        raise ValueError(f"weights: expected > 0, found {weights}")
    order = {name: i for i, name in enumerate(groups)}
    heap = [(0.5 / weights[name], order[name], name) for name, items in groups.items() if items]
    heapq.heapify(heap)
    taken = {name: 0 for name in groups}
    out: list[tuple[str, Any]] = []
    while heap:
        _, rank, name = heapq.heappop(heap)
        out.append((name, groups[name][taken[name]]))
        taken[name] += 1
        if taken[name] < len(groups[name]):
            heapq.heappush(heap, ((taken[name] + 0.5) / weights[name], rank, name))
    return out


def prompt_text(rec: dict[str, Any]) -> str:
    return "\n".join(m.get("content") or "" for m in rec["messages"] if m.get("role") == "user")


def mix(parts: list[MixPart], out: Path, seed: int = 0, follow_up_share: float = 0.3,
        count_tokens: Callable[[list[str]], list[int]] | None = None, sample: int = 2000) -> dict[str, Any]:
    """Write the parts' prompts to ``out`` (atomically: a temp file, then rename), interleaved by
    weight (module docstring); exact duplicates across parts (same user text) are kept once, the
    first part listed winning. Every record keeps its own ``source`` and gains ``mix_part``.
    ``count_tokens`` (texts -> token counts) estimates the share over 1,000 tokens on ``sample``
    prompts drawn with ``seed``. -> the report (per part: available, written; the share)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    groups: dict[str, list[dict[str, Any]]] = {}
    report: dict[str, Any] = {"parts": {}}
    for part in parts:
        rows = read_prompts(part.path) if part.path.exists() else []
        kept = []
        for rec in rows:
            key = " ".join(prompt_text(rec).split()).lower()
            if key and key not in seen:
                seen.add(key)
                kept.append(rec)
        rng.shuffle(kept)
        follow_ups = 0
        for rec in kept:
            rec["mix_part"] = part.name
            users = [m for m in rec["messages"] if m.get("role") == "user"]
            if part.follow_ups and len(users) == 1 and rng.random() < follow_up_share:
                rec["messages"] = rec["messages"] + [{"role": "user", "content": rng.choice(FOLLOW_UPS)}]
                follow_ups += 1
        groups[part.name] = kept
        report["parts"][part.name] = {"path": str(part.path), "read": len(rows), "kept": len(kept),
                                      "weight": part.weight, "with_follow_up": follow_ups}
    mixed = interleave(groups, {p.name: p.weight for p in parts})
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for _, rec in mixed:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
    report.update({"out": str(out), "prompts": len(mixed), "bytes": out.stat().st_size, "seed": seed})
    # The prefix up to where the first part ran out holds every part in its weight's proportion.
    taken = {n: 0 for n in groups}
    report["balanced_prefix"] = len(mixed)
    for i, (n, _) in enumerate(mixed):
        taken[n] += 1
        if taken[n] == len(groups[n]):
            report["balanced_prefix"] = i + 1
            break
    if count_tokens is not None and mixed:
        # sample 0: every prompt (exact, minutes on 2 cores for 240k), counted in chunks to bound memory
        picked = rng.sample(range(len(mixed)), min(sample, len(mixed))) if sample else range(len(mixed))
        counts: list[int] = []
        for lo in range(0, len(picked), 4096):
            counts += count_tokens([prompt_text(mixed[i][1]) for i in picked[lo:lo + 4096]])
        report["long_share_estimate"] = {"over_1000_tokens": round(sum(c > 1000 for c in counts) / len(counts), 4),
                                         "sample": len(counts), "mean_tokens": round(sum(counts) / len(counts), 1),
                                         "prompts_over_1000": sum(c > 1000 for c in counts), "exact": not sample}
    log(f"mix: {len(mixed)} prompts to {out}: " + ", ".join(f"{n} {len(g)}" for n, g in groups.items()))
    return report


def compact_documents(src: Path, dest: Path) -> int:
    """``src``'s prompts about documents, gzipped into ``dest`` without their content (which is the
    document and the request): each record keeps its ``source``, which names the document and holds
    the request. The compact file is what travels between sessions; :func:`expand_documents`
    rebuilds it from the documents. -> records written."""
    n = 0
    tmp = dest.with_name(dest.name + ".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        for rec in read_prompts(src):
            f.write(json.dumps({"id": rec["id"], "source": rec["source"]}, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, dest)
    return n


def expand_documents(src: Path, documents: Path, dest: Path) -> int:
    """The prompts of a :func:`compact_documents` file again, each the document its source names
    (its first ``source.document_chars`` characters where given) and then its request
    (:func:`eyas.data.prompts.document_prompt`, as ``eyas prompts`` wrote it),
    into ``dest`` (atomically). A document missing from ``documents`` is an error naming the file,
    the line and the id. -> records written."""
    from eyas.data.prompts import Document, document_prompt, read_documents

    docs = {d.id: d for d in read_documents(documents)}
    tmp = dest.with_name(dest.name + ".tmp")
    n = 0
    with gzip.open(src, "rt", encoding="utf-8") as f, tmp.open("w", encoding="utf-8") as out:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            doc_id = rec["source"].get("document")
            if doc_id not in docs:
                raise ValueError(f"{src}:{i}: source.document: expected an id of {documents}, found {doc_id!r}")
            doc = docs[doc_id]
            chars = rec["source"].get("document_chars", len(doc.text))  # eyas prompts may have cut it
            content = document_prompt(Document(doc.id, doc.text[:chars]), rec["source"]["request"])
            out.write(json.dumps({**rec, "messages": [{"role": "user", "content": content}]}, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, dest)
    return n


def grow(target: str, work: Path, deadline: float, run_cli: Callable[..., tuple[int | None, float, str]],
         magpie: int, documents: Path | None, doc_prompts: int, rows: int, device: str,
         last_json: Callable[[str], dict[str, Any] | None], max_new_tokens: int = 256,
         doc_temperatures: str = "0.7,0.9", doc_max_new_tokens: int = 96) -> dict[str, Any]:
    """The target writes prompts (``eyas prompts``): ``magpie`` Magpie user turns into
    WORK/magpie.jsonl, then ``doc_prompts`` requests about the ``documents`` into
    WORK/doc_prompts.jsonl. A prompt longer than ``max_new_tokens`` is dropped; a request about a
    document longer than ``doc_max_new_tokens``, and requests are drawn at ``doc_temperatures``: a
    request is short, a runaway row holds its batch for every token allowed, and at 1.2 SmolLM2
    wrote requests like "Translate the first paragraph into mathematics" (H100, 2026-12-07).
    The documents get the time left after Magpie's share (its count's share of all asked, at
    least half): each command is killed at its deadline and what it wrote stays. -> per file: exit
    code, seconds, prompts written, what was asked (temperatures, max new tokens), the command's
    JSON report."""
    jobs = [("magpie", magpie, None)] + ([("doc_prompts", doc_prompts, documents)] if documents and doc_prompts else [])
    jobs = [j for j in jobs if j[1] > 0]
    report: dict[str, Any] = {}
    total = sum(n for _, n, _ in jobs)
    for i, (name, count, docs) in enumerate(jobs):
        left = deadline - time.time()
        share = 1.0 if i == len(jobs) - 1 else max(0.5, count / total)
        out = work / f"{name}.jsonl"
        asked = {"max_new_tokens": max_new_tokens, "temperatures": None}  # None: eyas prompts' default
        if docs:
            asked = {"max_new_tokens": min(max_new_tokens, doc_max_new_tokens), "temperatures": doc_temperatures}
        args = ["prompts", "--target", target, "--out", str(out), "--count", str(count), "--rows", str(rows),
                "--max-new-tokens", str(asked["max_new_tokens"]), "--device", device, "--json"] \
            + (["--documents", str(docs), "--temperatures", doc_temperatures] if docs else [])
        code, wall, text = run_cli(args, time.time() + share * left, name)
        rep = last_json(text) or {}
        written = sum(1 for line in out.read_bytes().split(b"\n") if line.strip()) if out.exists() else 0
        report[name] = {"exit": code, "wall_s": round(wall, 1), "prompts": written, "path": str(out), "asked": asked,
                        **{k: rep.get(k) for k in ("generated", "kept_share", "rejected", "per_temperature")}}
    return report
