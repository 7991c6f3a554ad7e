# idea: Use tf-idf weighted word unigrams and bigrams instead of raw word counts.
# category: data
# tasks: TEXT
# block: data
# replace: vectorizer = .*

from sklearn.feature_extraction.text import TfidfVectorizer

vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
