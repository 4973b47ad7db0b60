// Command kstatus prints the kstatus result (sigs.k8s.io/cli-utils pkg/kstatus/status, the library
// Flux's health checks use) for each Kubernetes object read as JSON from stdin (one object, or a
// List / JSON array). Output: one JSON line per object {"kind","name","status","message"}.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	var raw any
	if err := utiljson.Unmarshal(data, &raw); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus: stdin is not JSON:", err)
		os.Exit(2)
	}
	var objs []map[string]any
	switch v := raw.(type) {
	case []any:
		for _, o := range v {
			objs = append(objs, o.(map[string]any))
		}
	case map[string]any:
		if items, ok := v["items"].([]any); ok {
			for _, o := range items {
				objs = append(objs, o.(map[string]any))
			}
		} else {
			objs = append(objs, v)
		}
	}
	enc := json.NewEncoder(os.Stdout)
	for _, o := range objs {
		u := &unstructured.Unstructured{Object: o}
		res, err := status.Compute(u)
		if err != nil {
			fmt.Fprintln(os.Stderr, "kstatus:", err)
			os.Exit(1)
		}
		_ = enc.Encode(map[string]string{
			"kind": u.GetKind(), "name": u.GetName(), "status": res.Status.String(), "message": res.Message,
		})
	}
}
