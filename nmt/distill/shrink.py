"""`nmt distill --init teacher`: the student starts from the teacher's own weights, not from scratch.

Shrink and fine-tune (Shleifer and Rush 2020, the DistilBART students): a student of the teacher's width
takes its embeddings, output bias and final norms, and of each stack the teacher's layers spread evenly
from the first to the last (a 1-layer decoder: the first, as theirs); the distillation then trains it on
the teacher's output as usual. The student's encoder already reads sources as the teacher's does, so its
training budget goes to the shallower decoder.
"""

from __future__ import annotations

import re

from torch import Tensor

from nmt.config import ModelConfig
from nmt.errors import ConfigError

LAYER = re.compile(r"^(encoder|decoder)\.(\d+)\.(.*)$")
SAME = ("d_model", "d_ff", "heads", "norm", "output_bias")  # what a copied weight's meaning depends on


def picks(teacher_layers: int, student_layers: int) -> list[int]:
    """The teacher's layers a student stack of `student_layers` copies: evenly spread, first and last
    included where there are two or more, the first alone for one."""
    if student_layers == 1:
        return [0]
    return [round(i * (teacher_layers - 1) / (student_layers - 1)) for i in range(student_layers)]


def check_shapes(teacher: ModelConfig, student: ModelConfig) -> dict[str, list[int]]:
    """The teacher's layers each student stack takes; a ConfigError naming the key where the student
    cannot start from the teacher (another width, a deeper stack). Cheap: `nmt distill` asks it before
    the teacher translates anything."""
    for key in SAME:
        if getattr(teacher, key) != getattr(student, key):
            raise ConfigError(
                f"--init teacher: the student's model.{key} {getattr(student, key)} is not the teacher's "
                f"{getattr(teacher, key)}; a student starts from the teacher's weights only at its width"
            )
    layers = {}
    for stack in ("encoder", "decoder"):
        t, s = getattr(teacher, f"{stack}_layers"), getattr(student, f"{stack}_layers")
        if s > t:
            raise ConfigError(
                f"--init teacher: the student's model.{stack}_layers {s} is more than the teacher's {t}"
            )
        layers[stack] = picks(t, s)
    return layers


def shrink(
    teacher: ModelConfig, teacher_state: dict[str, Tensor], student: ModelConfig, student_keys
) -> dict:
    """The student's initial weights (its state dict's `student_keys`) from the teacher's state dict."""
    layers = check_shapes(teacher, student)
    state = {}
    for key in student_keys:
        m = LAYER.match(key)
        source = f"{m[1]}.{layers[m[1]][int(m[2])]}.{m[3]}" if m else key
        if source not in teacher_state:
            raise ConfigError(f"--init teacher: the teacher has no weight {source} for the student's {key}")
        state[key] = teacher_state[source].clone()
    return state
