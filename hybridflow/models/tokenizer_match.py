"""Whether two tokenizers spell every token the same way: a teacher that scores the student's token ids (on-policy
distillation) must read id i as the student wrote it, or its logprobs belong to other text."""

from __future__ import annotations

from typing import Any

MAX_LISTED = 5  # differing tokens named in a message: enough to recognise the cause, short enough to read


def _special_ids(tokenizer: Any) -> dict[str, int | None]:
    return {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}


def tokenizer_differences(student: Any, teacher: Any) -> list[str]:
    """What makes a teacher read the student's token ids as other text, in words (empty: nothing): a different
    vocabulary (token -> id, added tokens included) or a different set of special tokens."""
    problems: list[str] = []
    own, other = student.get_vocab(), teacher.get_vocab()
    if own != other:
        problems.append(f"vocabulary: {len(own)} tokens vs the teacher's {len(other)}")
        changed = sorted(token for token in own.keys() & other.keys() if own[token] != other[token])
        if changed:
            listed = ", ".join(f"{token!r} ({own[token]} vs {other[token]})" for token in changed[:MAX_LISTED])
            problems.append(f"{len(changed)} tokens have other ids, e.g. {listed}")
        only_student = sorted(own.keys() - other.keys())
        if only_student:
            problems.append(f"{len(only_student)} of the student's tokens are not the teacher's, e.g. "
                            f"{', '.join(map(repr, only_student[:MAX_LISTED]))}")
        only_teacher = sorted(other.keys() - own.keys())
        if only_teacher:
            problems.append(f"{len(only_teacher)} of the teacher's tokens are not the student's, e.g. "
                            f"{', '.join(map(repr, only_teacher[:MAX_LISTED]))}")
    specials, teacher_specials = set(student.all_special_tokens), set(teacher.all_special_tokens)
    if specials != teacher_specials:
        problems.append(f"special tokens differ: the student's only {sorted(specials - teacher_specials)}, "
                        f"the teacher's only {sorted(teacher_specials - specials)}")
    return problems


def role_differences(student: Any, teacher: Any) -> list[str]:
    """Special tokens that play another role in the teacher (its eos, bos, pad or unk is another id). Harmless
    for scoring (the teacher reads ids, whatever it would stop on: a base model and its chat model differ so),
    so a note, not a refusal."""
    ids, teacher_ids = _special_ids(student), _special_ids(teacher)
    return [f"{name}_token_id {ids[name]} vs the teacher's {teacher_ids[name]}" for name in ids
            if ids[name] != teacher_ids[name]]
