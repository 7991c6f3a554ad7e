from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression

model = LogisticRegression(max_iter=1000)
