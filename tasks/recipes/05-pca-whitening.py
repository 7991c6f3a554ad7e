# idea: Project the pixels onto the principal components that keep 95% of the variance, whitened.
# category: data
# tasks: digits
# block: data

from sklearn.decomposition import PCA

# principal components keeping 95% of the variance, whitened
pca = PCA(n_components=0.95, whiten=True, random_state=0).fit(X)
X, X_test = pca.transform(X), pca.transform(X_test)
