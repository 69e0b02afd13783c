"""The calibration set of a target: prompts from the offline prompt set and its own answers.

    cal = make_calibration_set(gen, ArtifactLayout(artifacts).calibration, prompts=32)

A quantizer fitted on activations (GPTQ) should see the text the model will process: its chat
template, the prompt classes it serves, and its own answers (which is also what speculative
decoding verifies). So the set is made like the draft heads' training data (`data.py`), from
another seed of the prompt set, held out from the benchmark, with greedy answers of the target's
float32 engine; the answers are kept on disk (resumable) and the set records what made it.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

from specrt.artifacts import atomic_write_text
from specrt.calibration.data import CalibrationSet
from specrt.errors import SpecrtError
from specrt.runtime.generator import Generator
from specrt.training.data import generate_answers
from specrt.training.prompts import PROMPT_SET_VERSION, build_prompt_set

CALIBRATION_SEED = 1  # the draft heads' data uses seed 0: other prompts
SET_FILE, ANSWERS_FILE, IDENTITY_FILE = "set.json", "answers.jsonl", "identity.json"


def make_calibration_set(
    gen: Generator,
    out: str | Path,
    prompts: int = 32,
    max_new_tokens: int = 128,
    hold_out: tuple[str, ...] = (),
    progress: bool = True,
) -> CalibrationSet:
    """The set in `out`/set.json, made (or completed) when missing or made otherwise."""
    out = Path(out)
    source = {
        "prompt_set": {"version": PROMPT_SET_VERSION, "seed": CALIBRATION_SEED, "python": platform.python_version()},
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "answers": "greedy, the target's own",
        "held_out_prompts": len(hold_out),
    }
    ckpt = gen.session.caps.checkpoint_hash
    if ckpt is None:
        raise SpecrtError("this engine records no checkpoint hash; calibrate with an engine built by specrt")
    if (out / SET_FILE).is_file():
        try:
            have = CalibrationSet.load(out / SET_FILE)
        except SpecrtError:
            have = None
        if have is not None and have.source == source and have.checkpoint_hash == ckpt:
            return have
    # answers of an interrupted run with these settings are kept; any others are not reused
    identity = json.dumps({"checkpoint_hash": ckpt, **source}, sort_keys=True)
    marker = out / IDENTITY_FILE
    if not marker.is_file() or marker.read_text() != identity:
        (out / ANSWERS_FILE).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(marker, identity)
    chosen = build_prompt_set(prompts, CALIBRATION_SEED, exclude=hold_out)
    answers = generate_answers(gen, chosen, out / ANSWERS_FILE, max_new_tokens, batch=16, progress=progress)
    cal = CalibrationSet(ckpt, source, tuple(tuple(a.prompt_ids + a.answer_ids) for a in answers))
    cal.save(out / SET_FILE)
    return cal
