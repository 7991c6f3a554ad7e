"""Can the quick pipeline's tiny model learn to copy from its context, and how fast? (not collected by pytest)

Issue 42's student does not copy the ideas of its prompt, nor its own plan from the history (tests/RESULTS.md, "does
the student copy at all?"). Copying is what induction heads do (Olsson et al. 2022, "In-context learning and
induction heads"); a pre-trained Qwen has them, a model trained from scratch for minutes may not. This trains
sft.py's tiny configuration on random tokens in which a span appears twice, the loss on the second copy only, and
prints the copy loss (chance: ln of the token range) and the next-token accuracy on the copy as it goes.

  python tests/bench_copy.py                      # vocabulary 8,192 (the pipeline's), width 128, 2 blocks
  python tests/bench_copy.py --tokens 64          # spans drawn from 64 ids: an easier task
"""
import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model  # noqa: E402


def batch(rows, length, tokens, g):
    """Random ids in [0, tokens), one span of 8-63 repeated later in each row; the mask marks the predictable copy."""
    x, mask = torch.randint(0, tokens, (rows, length), generator=g), torch.zeros(rows, length, dtype=torch.bool)
    for b in range(rows):
        n = int(torch.randint(8, 64, (), generator=g))
        p = int(torch.randint(0, length - 2 * n - 8, (), generator=g))
        q = int(torch.randint(p + n + 1, length - n, (), generator=g))
        x[b, q:q + n] = x[b, p:p + n]
        mask[b, q + 1:q + n] = True  # the copy's first token is not predictable
    return x, mask


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=8192, help="model vocabulary (sft.py --scratch-vocab)")
    p.add_argument("--tokens", type=int, default=8192, help="ids the sequences draw from")
    p.add_argument("--hidden", type=int, default=128, help="width (sft.py --scratch-hidden)")
    p.add_argument("--layers", type=int, default=2, help="blocks (sft.py --scratch-layers)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (sft.py's from scratch)")
    p.add_argument("--rows", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=20, help="print every N steps")
    p.add_argument("--seed", type=int, default=0, help="the weights' and the sequences' seed")
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    cfg = model.tiny_config("qwen3", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                            num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=a.hidden // 4, max_position_embeddings=max(2048, a.length))
    lm, g, start = model.Qwen(cfg), torch.Generator().manual_seed(a.seed), time.time()
    opt = torch.optim.AdamW(lm.parameters(), lr=a.lr, weight_decay=0.0)
    print(f"chance: copy loss {math.log(a.tokens):.3f}, accuracy {1 / a.tokens:.3f}")
    for step in range(1, a.steps + 1):
        x, mask = batch(a.rows, a.length, a.tokens, g)
        logits, m = lm(x)[:, :-1], mask[:, 1:]
        loss = (F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none") * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.every == 0:
            acc = ((logits.argmax(-1) == x[:, 1:]) & m).sum() / m.sum()
            print(f"step {step} copy loss {loss.item():.3f} accuracy {acc.item():.3f} {time.time() - start:.0f}s",
                  flush=True)


if __name__ == "__main__":
    main()
