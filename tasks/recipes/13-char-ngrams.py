# idea: Add character 2- to 4-gram tf-idf features to the word features.
# category: data
# tasks: TEXT
# block: data

from scipy.sparse import hstack
from sklearn.feature_extraction.text import TfidfVectorizer

# add character 2-4-gram tf-idf features
chars = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), min_df=3, sublinear_tf=True)
X = hstack([X, chars.fit_transform(train["text"])]).tocsr()
X_test = hstack([X_test, chars.transform(test["text"])]).tocsr()
