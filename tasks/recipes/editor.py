"""The offline stand-in for the LLM editor of `Edit Script (AI)`, so that everything runs with no network and no API
key: it knows only the recipes in this folder, each one real code change to a built-in starter script in one of
ML-Agent's idea categories (arXiv:2505.23723, §"Exploration-enriched fine-tuning": data, model, learning).
env.py loads this file (runpy) and offers it as env.recipe_editor; agent.py's LLM editor replaces it when configured.

A recipe appends lines to the `# --- data ---` or `# --- model ---` block of a starter, or replaces one line of it,
so recipes compose. One file each, NN-<name>.py, in the order they are offered: `# key: value` header lines (idea,
category, tasks, block, replace), a blank line, the imports it needs and a blank line, then its code; $kind,
$scoring, $selector and $voting are filled in for the script's task (tasks/README.md says more).

Run: python tasks/recipes/editor.py digits standardize   (prints the digits starter with that recipe applied)
"""
import re
import string
import sys
from dataclasses import dataclass
from pathlib import Path

SCORING = {"accuracy": "accuracy", "f1_macro": "f1_macro", "roc_auc": "roc_auc", "log_loss": "neg_log_loss",
           "mae": "neg_mean_absolute_error", "rmse": "neg_root_mean_squared_error"}  # scikit-learn's scorer names


@dataclass(frozen=True)
class Recipe:
    name: str
    category: str  # "data" | "model" | "learning"
    idea: str  # one-sentence instruction; given to the editor it applies this recipe
    tasks: tuple[str, ...]
    section: str  # the starter block edited: "data" or "model"
    code: str  # lines appended to the block, or replacing the line that `replace` matches
    imports: tuple[str, ...] = ()
    replace: str | None = None  # regex of the block line to replace


def _groups(tasks: dict) -> dict[str, tuple[str, ...]]:
    """The names a recipe's `# tasks:` line may use besides task names, joined by + and -."""
    groups = {"TEXT": tuple(n for n, s in tasks.items() if s.modality == "text"),
              "CLASSIFY": tuple(n for n, s in tasks.items() if s.kind == "classification" and s.modality != "text"),
              "REGRESS": tuple(n for n, s in tasks.items() if s.kind == "regression"),
              "SERIES": tuple(n for n, s in tasks.items() if s.modality == "time series"),
              "MISSING": tuple(n for n, s in tasks.items() if s.missing)}
    return {**groups, "NUMERIC": groups["CLASSIFY"] + groups["REGRESS"]}


def _recipe_tasks(expression: str, tasks: dict, groups: dict) -> tuple[str, ...]:
    """`NUMERIC + TEXT`, `NUMERIC - digits`, `house-prices`: the tasks, in the order the groups list them."""
    words = ["+", *expression.split()]
    names: tuple[str, ...] = ()
    for sign, word in zip(words[::2], words[1::2]):
        these = groups.get(word) or ((word,) if word in tasks else None)
        if sign not in "+-" or these is None:
            raise ValueError(f"recipe tasks {expression!r}: not groups and tasks joined by ' + ' and ' - '")
        names = names + these if sign == "+" else tuple(n for n in names if n not in these)
    return names


def read_recipes(tasks: dict) -> list[Recipe]:
    """Every recipe file of this folder, in order: its header, then (after a blank line) its imports and (after
    another) its code. `tasks`: env.BUILTIN_TASKS, whose kinds the `# tasks:` groups name."""
    groups, recipes = _groups(tasks), []
    for path in sorted(Path(__file__).parent.glob("[0-9][0-9]-*.py")):
        lines = path.read_text().removesuffix("\n").split("\n")
        head = {}
        while lines and (m := re.fullmatch(r"# (idea|category|tasks|block|replace): (.*)", lines[0])):
            head[m.group(1)] = m.group(2)
            lines.pop(0)
        body = lines[1:]
        n = next((i for i, line in enumerate(body) if not line.startswith(("import ", "from "))), len(body))
        if lines[:1] != [""] or (n and body[n:n + 1] != [""]):
            raise ValueError(f"{path}: a blank line must end the header, and another the imports")
        recipes.append(Recipe(path.stem.split("-", 1)[1], head["category"], head["idea"],
                              _recipe_tasks(head["tasks"], tasks, groups), head["block"],
                              "\n".join(body[n + 1:] if n else body), tuple(body[:n]), head.get("replace")))
    return recipes


def _apply(recipe: Recipe, code: str, spec) -> str:
    clf = spec.kind == "classification"
    fill = dict(kind="Classifier" if clf else "Regressor", scoring=SCORING[spec.metric],
                selector="f_classif" if clf else "f_regression", voting=', voting="soft"' if clf else "")
    lines = code.splitlines()
    marker = f"# --- {recipe.section} ---"
    if marker not in lines:
        raise ValueError(f"recipe {recipe.name} edits the {marker!r} block, which this script does not have")
    start = lines.index(marker) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("# --- ")), len(lines))
    new = string.Template(recipe.code).substitute(fill).splitlines()
    if recipe.replace:
        at = next((i for i in range(start, end) if re.fullmatch(recipe.replace, lines[i])), None)
        if at is None:
            raise ValueError(f"recipe {recipe.name} replaces a line like {recipe.replace!r}, not found in {marker!r}")
        lines[at:at + 1] = new
    else:
        while end > start and not lines[end - 1].strip():  # before the blank lines that close the block
            end -= 1
        lines[end:end] = new
    imports = [string.Template(i).substitute(fill) for i in recipe.imports]
    last = max((i for i, line in enumerate(lines) if line.startswith(("import ", "from "))), default=-1)
    lines[last + 1:last + 1] = [i for i in dict.fromkeys(imports) if i not in lines]
    return "\n".join(lines) + "\n"


def edit(instruction: str, code: str, tasks: dict, recipes: list[Recipe]) -> str:
    """The script with the recipe applied whose idea or name the instruction contains; ValueError, with the reason,
    when there is none (env.recipe_editor raises it as EditError)."""
    # An editor gets only (instruction, code), as the LLM editor does (Env, ppo.py, collect.py, agent.py call it so):
    # the starter's docstring, which no recipe edits, is what tells which built-in task's recipes fit the script.
    found = re.search(r'Starter script for the "([\w-]+)" task', code)
    if not found or found.group(1) not in tasks:
        raise ValueError("the offline recipe editor only edits the built-in starter scripts; configure an LLM editor "
                         "for other code")
    task, text = found.group(1), instruction.lower()
    fits = [r for r in recipes if task in r.tasks]
    hits = [(len(key), r) for r in fits for key in (r.idea.lower(), r.name, r.name.replace("-", " ")) if key in text]
    if not hits:
        raise ValueError(f"no offline recipe matches this instruction; configure an LLM editor for free-form edits. "
                         f"Recipes for {task}: {', '.join(r.name for r in fits)}")
    return _apply(max(hits, key=lambda h: h[0])[1], code, tasks[task])


if __name__ == "__main__":  # from the project's folder: env.py loads the tasks and this editor
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import env
    print(env.recipe_editor(sys.argv[2], env.BUILTIN_TASKS[sys.argv[1]].starter), end="")
