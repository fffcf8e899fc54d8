package api

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/gin-gonic/gin"
)

// BenchmarkReadJSON is the reading of a text push's body, as every command
// request's body is read: checks, decoding, and the split into members.
func BenchmarkReadJSON(b *testing.B) {
	body := `{"text":"Your parcel is at the door","title":"Delivery","ttl_seconds":3600}`
	gin.SetMode(gin.ReleaseMode)
	w := httptest.NewRecorder()
	c, _ := gin.CreateTestContext(w)
	b.ReportAllocs()
	for b.Loop() {
		c.Request = httptest.NewRequest("POST", "/api/v1/devices/dev-1/push/text", strings.NewReader(body))
		c.Request.Header.Set("Content-Type", "application/json")
		var req pushTextRequest
		if _, err := readJSON(c, 1<<16, false, &req); err != nil {
			b.Fatal(err)
		}
	}
}
