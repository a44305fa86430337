total = price * qty * 1.2  # euros
