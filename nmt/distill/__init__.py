"""Sequence-level knowledge distillation (Kim and Rush, 2016): `nmt distill` trains a small student on
what a teacher translates.

options (what the command takes beside the recipe: its defaults and checks), steps (the resumable
command: source text, teacher n-best in chunks, selection, filtering, the student's
data under the teacher's subwords, training, averaging, the comparison), select (which hypothesis of an
n-best list to keep; what to drop then is nmt.data.filters), compare (teacher against student
on the test sets, per engine and precision), shrink (a student initialised from the teacher's own weights,
--init teacher).
"""

from nmt.distill.options import DistillOptions

__all__ = ["STEPS", "DistillOptions", "distill"]


def __getattr__(name: str):
    """The command itself, imported when first asked for: `nmt distill`'s options read DistillOptions from
    here, and the CLI must not import torch (the teacher's) to show its help."""
    if name not in ("STEPS", "distill"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from nmt.distill import steps

    found = globals()[name] = getattr(steps, name)
    return found
