package daemon

import (
	"compress/gzip"
	"net/http"
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// metricsHandler serves g's metrics, gzipped at the fastest level when
// the scraper asks (Prometheus does): promhttp's default level costs a
// large scrape several times the CPU for a few percent fewer bytes
// (docs/metrics.md has the figures).
func metricsHandler(g prometheus.Gatherer) http.Handler {
	plain := promhttp.HandlerFor(g, promhttp.HandlerOpts{DisableCompression: true})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Add("Vary", "Accept-Encoding")
		if !acceptsGzip(r.Header.Get("Accept-Encoding")) {
			plain.ServeHTTP(w, r)
			return
		}
		gw := &gzipWriter{ResponseWriter: w}
		defer gw.close()
		plain.ServeHTTP(gw, r)
	})
}

// acceptsGzip reports whether an Accept-Encoding header takes gzip.
func acceptsGzip(header string) bool {
	for _, part := range strings.Split(header, ",") {
		coding, params, _ := strings.Cut(part, ";")
		if strings.TrimSpace(coding) != "gzip" {
			continue
		}
		q, found := strings.CutPrefix(strings.TrimSpace(params), "q=")
		if !found {
			return true
		}
		weight, err := strconv.ParseFloat(q, 64)
		return err == nil && weight > 0
	}
	return false
}

var gzipWriters = sync.Pool{New: func() any {
	w, _ := gzip.NewWriterLevel(nil, gzip.BestSpeed) // a valid level: no error
	return w
}}

// gzipWriter gzips a response whose status is 200 OK; another's (an
// error promhttp writes as text) goes as it is.
type gzipWriter struct {
	http.ResponseWriter
	wrote bool
	z     *gzip.Writer
}

func (g *gzipWriter) WriteHeader(status int) {
	if g.wrote {
		return
	}
	g.wrote = true
	if status == http.StatusOK {
		g.Header().Set("Content-Encoding", "gzip")
		g.Header().Del("Content-Length")
		g.z = gzipWriters.Get().(*gzip.Writer)
		g.z.Reset(g.ResponseWriter)
	}
	g.ResponseWriter.WriteHeader(status)
}

func (g *gzipWriter) Write(b []byte) (int, error) {
	g.WriteHeader(http.StatusOK)
	if g.z == nil {
		return g.ResponseWriter.Write(b)
	}
	return g.z.Write(b)
}

// close ends the gzip stream, if any.
func (g *gzipWriter) close() {
	if g.z != nil {
		g.z.Close()
		gzipWriters.Put(g.z)
	}
}
