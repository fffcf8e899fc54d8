package companion

import "time"

// Firmware is one published firmware image for a model.
type Firmware struct {
	Model     string    `json:"model"`
	Version   string    `json:"version"`
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// AppRelease is one published version of an app package.
type AppRelease struct {
	AppID     string    `json:"app_id"`
	Version   string    `json:"version"`
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}

// Blob is content stored once by its SHA-256 (lower-case hex).
type Blob struct {
	SHA256    string    `json:"sha256"`
	Size      int64     `json:"size"`
	CreatedAt time.Time `json:"created_at"`
}
