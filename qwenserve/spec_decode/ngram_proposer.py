"""Prompt lookup (n-gram) proposals: find the sequence's last n tokens earlier in its own tokens (prompt and
output) and propose what followed them there. No model runs; on repetitive text (code edits, quoting, loops)
the guesses are often right, and the target model verifies every one of them."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        """min_n / max_n: the shortest and longest suffix n-gram that may match (prompt_lookup_min / _max)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose_batch(self, requests: list[tuple]) -> list[list[int]]:
        """(sequence state, its tokens, how many proposals) each -> the proposals of each (the proposer interface
        the model runner calls; draft_model.py's shares it)."""
        return [self.propose(tokens, num) for _, tokens, num in requests]

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to num_tokens guesses of what follows token_ids; [] when its last min_n tokens occur nowhere
        earlier. The longest matching suffix (up to max_n) wins, and of equally long ones the most recent: a
        sequence that has started to repeat itself most likely repeats its latest round."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        total, n = len(tokens), self.min_n
        if num_tokens < 1 or total <= n:
            return []
        # every earlier n-gram equal to the last one, by the index just past it (never the suffix itself)
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:total - 1], n)
        ends = np.flatnonzero((windows == tokens[total - n:]).all(axis=1)) + n
        if not ends.size:
            return []
        # lengthen each match backwards while it still equals the suffix, up to max_n
        lengths = np.full(ends.shape, n)
        for length in range(n, self.max_n):
            growing = np.flatnonzero((lengths == length) & (ends > length))
            if not growing.size:
                break
            same = tokens[ends[growing] - length - 1] == tokens[total - length - 1]
            lengths[growing[same]] += 1
        end = int(ends[lengths == lengths.max()][-1])
        # what followed the match; past the sequence's end the copy continues from its own guesses, so a loop
        # whose period is shorter than num_tokens is proposed for its full length
        proposal: list[int] = []
        for i in range(num_tokens):
            at = end + i
            proposal.append(int(tokens[at]) if at < total else proposal[at - total])
        return proposal
