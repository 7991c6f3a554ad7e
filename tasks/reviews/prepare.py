"""The rows of the "reviews" task: product reviews generated from word lists, with
negations and a share of noisy labels.

Run: python tasks/reviews/prepare.py   (prints the table; `python env.py prepare reviews` makes the task folder)
"""
import numpy as np
import pandas as pd


def rows(n=2400, seed=0, balance=(0.3, 0.25, 0.45), noise=0.05) -> pd.DataFrame:
    """Product reviews from word lists; negations ("not great") flip a phrase, and a share of labels is noise.
    balance: the shares of negative, neutral and positive reviews; noise: the share of random labels."""
    rng = np.random.default_rng(seed)
    words = {
        "product": "blender kettle headphones backpack lamp toaster keyboard charger jacket tent".split(),
        "pos": "great excellent sturdy comfortable reliable fantastic quiet fast lovely perfect".split(),
        "neg": "broken flimsy noisy slow awful useless cheap disappointing faulty uncomfortable".split(),
        "mid": "okay average decent fine acceptable ordinary mediocre standard".split(),
        "filler": "i bought this for my kitchen last week after reading reviews the delivery was on time and it "
                  "came in a box with a manual".split(),
    }
    templates = ["the {p} is {w}", "{w} {p}", "really {w}", "it feels {w}", "honestly {w}"]
    negated = ["the {p} is not {w}", "not {w} at all", "never {w}", "not a {w} {p}"]
    # label -> probabilities of a phrase being: positive, negative, middling, negated positive, negated negative
    mix = {"positive": [0.65, 0.05, 0.08, 0.02, 0.2], "negative": [0.05, 0.6, 0.08, 0.22, 0.05],
           "neutral": [0.12, 0.12, 0.66, 0.05, 0.05]}
    labels = rng.choice(["negative", "neutral", "positive"], size=n, p=list(balance))
    rows = []
    for label in labels:
        p = rng.choice(words["product"])
        phrases = []
        for kind in rng.choice(5, size=rng.integers(2, 6), p=mix[label]):
            pool = words[("pos", "neg", "mid", "pos", "neg")[kind]]
            phrase = rng.choice(templates if kind < 3 else negated)
            phrases.append(phrase.format(p=p, w=rng.choice(pool)))
        phrases.append(" ".join(rng.choice(words["filler"], size=rng.integers(3, 9))))
        rng.shuffle(phrases)
        rows.append(", ".join(phrases))
    noisy = rng.random(n) < noise
    labels[noisy] = rng.choice(["negative", "neutral", "positive"], size=noisy.sum())
    return pd.DataFrame({"text": rows, "sentiment": labels})


if __name__ == "__main__":
    print(rows())
