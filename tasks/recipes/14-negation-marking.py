# idea: Mark the word after a negation ("not great" becomes "not NOT_great").
# category: data
# tasks: TEXT
# block: data

# mark the word after a negation so that "not great" does not count as "great"
def negate(texts):
    return texts.str.replace(r"\b(not|never|no)\s+(?:a\s+)?(\w+)", r"\1 NOT_\2", regex=True)


X = vectorizer.fit_transform(negate(train["text"]))
X_test = vectorizer.transform(negate(test["text"]))
