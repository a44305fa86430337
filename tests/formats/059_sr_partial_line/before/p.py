total = price * qty  # euros
