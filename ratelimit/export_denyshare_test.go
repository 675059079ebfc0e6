package ratelimit

// ForgetLocalDenial drops key from l's own deny cache, so that its next
// check asks PostgreSQL again.
func ForgetLocalDenial(l *Limiter, key string) { l.deny.forget(key) }
