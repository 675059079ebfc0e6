// Package frameworks shows package httplimit in front of the two most used
// Go web frameworks, gin and echo, in tested examples. It is a module of
// its own, so that pgrl's core module carries neither framework.
//
// Echo takes httplimit's net/http middleware as it is, through
// echo.WrapMiddleware:
//
//	e.Use(echo.WrapMiddleware(mw.Handler))
//
// Gin's middleware is a gin.HandlerFunc that must stop the chain itself
// when it answers; package ginlimit is the few lines that do it:
//
//	r.Use(ginlimit.Middleware(mw))
//
// In both, the request a handler sees has passed the limit, and a refused
// request is answered by httplimit (429 with Retry-After and the
// RateLimit fields, or its Config.OnDeny) without reaching the handler.
package frameworks
