// Pins Traefik for `go build <package>` (go install refuses its module: it has replace directives). The
// replace and exclude lines below are Traefik v3.6.12's own, copied from its go.mod: a wrapper module must
// repeat them. v3.6.12, not v3.7.x: the v3.7 line needs module versions this machine's Go proxy refuses (403).
module embedops.local/traefik

go 1.26.0

require github.com/traefik/traefik/v3 v3.6.12

replace (
	github.com/abbot/go-http-auth => github.com/containous/go-http-auth v0.4.1-0.20200324110947-a37a7636d23e
	github.com/gorilla/mux => github.com/containous/mux v0.0.0-20250523120546-41b6ec3aed59
	github.com/mailgun/minheap => github.com/containous/minheap v0.0.0-20190809180810-6e71eb837595
)

exclude github.com/tencentcloud/tencentcloud-sdk-go v3.0.83+incompatible
