-- reconcile: drop expired versions from the accounting. Reply: the total after it.
reconcile(now_s())
return tonumber(redis.call('GET', TOTAL) or '0')
