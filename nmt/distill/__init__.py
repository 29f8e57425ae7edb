"""Sequence-level knowledge distillation (Kim and Rush, 2016): `nmt distill` trains a small student on
what a teacher translates.

steps (the resumable command: source text, teacher n-best in chunks, selection, filtering, the student's
data under the teacher's subwords, training, averaging, the comparison), select (which hypothesis of an
n-best list to keep; what to drop then is nmt.data.filters), compare (teacher against student
on the test sets, per engine and precision), shrink (a student initialised from the teacher's own weights,
--init teacher).
"""

from nmt.distill.steps import STEPS, DistillOptions, distill

__all__ = ["STEPS", "DistillOptions", "distill"]
