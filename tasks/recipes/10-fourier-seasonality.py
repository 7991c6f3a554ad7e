# idea: Add sine and cosine terms of the day of the year for yearly seasonality.
# category: data
# tasks: SERIES
# block: data

# yearly seasonality: sine and cosine of the first two yearly harmonics
def fourier(df):
    d = 2 * np.pi * pd.to_datetime(df["date"]).dt.day_of_year.to_numpy() / 365.25
    return np.column_stack([np.sin(d), np.cos(d), np.sin(2 * d), np.cos(2 * d)])


X, X_test = np.column_stack([X, fourier(train)]), np.column_stack([X_test, fourier(test)])
