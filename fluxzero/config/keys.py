"""Unknown keys of a run file's sections: the did-you-mean every section's refusal shares (stdlib only)."""
from __future__ import annotations


def did_you_mean(unknown, names) -> str:
    """' (did you mean 'rank' for 'rnak'?)' for the unknown keys with a close valid name, else ''."""
    import difflib

    hints = [f"{m[0]!r} for {k!r}" for k in unknown
             if (m := difflib.get_close_matches(str(k), sorted(map(str, names)), n=1, cutoff=0.6))]
    return f" (did you mean {', '.join(hints)}?)" if hints else ""
