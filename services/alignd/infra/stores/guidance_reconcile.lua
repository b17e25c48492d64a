-- reconcile: drop expired versions from the accounting. Reply: the total after it.
reconcile(now_s())
return done(tonumber(redis.call('GET', TOTAL) or '0'))
