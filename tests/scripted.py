"""Make a random tiny model write given tokens: while a sequence's output is a proper prefix of a script, the
script's next token gets a large bias after every mask the sampler applies, so a grammar that forbids it wins
(the output then leaves the script, which a test sees). Patches the sampler in this process: in-process engines
and live servers over them."""
import contextlib

from qwenserve.sample.sampler import Sampler

BIAS = 1e4  # over any logit of a tiny random model: the scripted token is certain, greedy or sampled


@contextlib.contextmanager
def scripted(*scripts: list[int]):
    original = Sampler.target_logits

    def target_logits(self, logits, rows, grammar=None):
        target, raw_logprobs = original(self, logits, rows, grammar)
        target = target.float().clone()  # the greedy fast path hands back the model's own logits
        for i, row in enumerate(rows):
            out = list(row.token_ids[row.num_prompt_tokens:])
            for script in scripts:
                if len(out) < len(script) and list(script[:len(out)]) == out:
                    target[i, script[len(out)]] += BIAS
                    break
        return target, raw_logprobs

    Sampler.target_logits = target_logits
    try:
        yield
    finally:
        Sampler.target_logits = original
