from sklearn.naive_bayes import GaussianNB

model = GaussianNB()
