package main

import (
	"encoding/json"
	"log/slog"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// routes registers the app's endpoints, each behind its limit.
func routes(l *limits, reg *prometheus.Registry, log *slog.Logger) *http.ServeMux {
	mux := http.NewServeMux()
	mux.Handle("POST /login", l.Login.HandlerFunc(login))
	mux.Handle("POST /contact", l.Contact.HandlerFunc(contact(l, log)))
	for _, p := range []string{"POST /admin/{resource}", "PUT /admin/{resource}/{id}", "DELETE /admin/{resource}/{id}"} {
		mux.Handle(p, l.AdminWrites.HandlerFunc(adminWrite))
	}
	mux.Handle("POST /upload", l.Uploads.HandlerFunc(upload))
	mux.Handle("GET /api/v1/{resource}", l.PublicAPI.HandlerFunc(publicAPI))
	mux.Handle("POST /beacon", l.Beacon.HandlerFunc(beacon))
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, http.StatusOK, map[string]any{"ok": true}) })
	return mux
}

// login is a stand-in for your sign-in handler: it only checks that the
// form is complete. The limits have already counted the attempt.
func login(w http.ResponseWriter, r *http.Request) {
	if normalizeEmail(r.PostFormValue("email")) == "" || r.PostFormValue("password") == "" {
		writeJSON(w, http.StatusBadRequest, map[string]any{"error": "email_and_password_required"})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"ok": true})
}

// contact accepts a message and sends a confirmation to the address typed
// into the form, at most 3 times a day per address (policy
// confirmation-email): anyone can type anyone's
// address, and the form must not become a way to flood an inbox. Past that
// limit the message is still accepted, without a confirmation.
func contact(l *limits, log *slog.Logger) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		email := normalizeEmail(r.PostFormValue("email"))
		if email == "" || r.PostFormValue("message") == "" {
			writeJSON(w, http.StatusBadRequest, map[string]any{"error": "email_and_message_required"})
			return
		}
		d, err := l.Confirmation.Allow(r.Context(), email)
		sent := err == nil && d.Allowed
		if err != nil {
			log.ErrorContext(r.Context(), "confirmation limit check failed", "err", err)
		}
		if sent {
			// Send the confirmation email here.
			log.InfoContext(r.Context(), "confirmation email sent")
		}
		writeJSON(w, http.StatusAccepted, map[string]any{"ok": true, "confirmation_sent": sent})
	}
}

// adminWrite stands in for the admin API's create, update and delete.
func adminWrite(w http.ResponseWriter, r *http.Request) {
	if _, ok := adminUser(r); !ok {
		writeJSON(w, http.StatusUnauthorized, map[string]any{"error": "unauthorized"})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"ok": true, "resource": r.PathValue("resource")})
}

// upload stands in for a media upload, which costs money at the image host.
func upload(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusCreated, map[string]any{"ok": true})
}

// publicAPI stands in for the public, read-only API.
func publicAPI(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"resource": r.PathValue("resource"), "items": []string{}})
}

// beacon accepts an analytics beacon.
func beacon(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNoContent) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
