

def features(df):
    """A day counter for the trend, the promotion flag, temperature, day of the week and store."""
    date = pd.to_datetime(df["date"])
    return pd.DataFrame({"t": (date - pd.Timestamp("2021-01-01")).dt.days, "promo": df["promo"],
                         "temperature": df["temperature"], "dow": date.dt.day_of_week, "store": df["store"]})


both = pd.get_dummies(pd.concat([features(train), features(test)]), columns=["dow", "store"], dtype=float)
X, X_test = both[: len(train)], both[len(train):]
# train.csv is in time order, so the validation split below (shuffle=False) holds out its latest days
