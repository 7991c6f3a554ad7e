vectorizer = CountVectorizer(min_df=2)
X = vectorizer.fit_transform(train["text"])
X_test = vectorizer.transform(test["text"])
